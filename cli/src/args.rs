//! Hand-rolled argument parsing: each command declares its options, and anything else is a
//! usage error that names the offending argument.

use std::collections::HashMap;

/// One option a command accepts: `--name VALUE` (also `--name=VALUE`) or a bare `--name` flag.
pub struct Opt {
    pub name: &'static str,
    pub takes_value: bool,
}

pub const fn flag(name: &'static str) -> Opt {
    Opt {
        name,
        takes_value: false,
    }
}

pub const fn value(name: &'static str) -> Opt {
    Opt {
        name,
        takes_value: true,
    }
}

/// A command line split into positional arguments and options.
#[derive(Debug, Default)]
pub struct Parsed {
    pub positional: Vec<String>,
    options: HashMap<&'static str, Option<String>>,
}

impl Parsed {
    pub fn flag(&self, name: &str) -> bool {
        self.options.contains_key(name)
    }

    pub fn value(&self, name: &str) -> Option<&str> {
        self.options.get(name).and_then(|v| v.as_deref())
    }

    /// The option's value parsed as a number, with an error naming the option.
    pub fn number<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, String> {
        self.value(name)
            .map(|text| {
                text.parse::<T>()
                    .map_err(|_| format!("--{name} {text:?}: expected a non-negative integer"))
            })
            .transpose()
    }

    /// A comma-separated list of numbers (`16,8`), with an error naming the option.
    pub fn numbers(&self, name: &str) -> Result<Option<Vec<u64>>, String> {
        self.value(name)
            .map(|text| {
                text.split(',')
                    .map(|part| {
                        part.trim().parse::<u64>().map_err(|_| {
                            format!("--{name} {text:?}: expected comma-separated non-negative integers, like 16,8")
                        })
                    })
                    .collect()
            })
            .transpose()
    }
}

/// True when the arguments ask for help (`-h`/`--help` before any `--`).
pub fn wants_help(args: &[String]) -> bool {
    args.iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "-h" || a == "--help")
}

/// Parses `args` against `options`. A repeated option keeps its last value.
pub fn parse(args: &[String], options: &[Opt]) -> Result<Parsed, String> {
    let mut parsed = Parsed::default();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if arg == "--" {
            parsed.positional.extend(rest.by_ref().cloned());
            break;
        }
        let Some(body) = arg.strip_prefix("--") else {
            if arg.len() > 1 && arg.starts_with('-') {
                return Err(format!("unknown option {arg:?}"));
            }
            parsed.positional.push(arg.clone());
            continue;
        };
        let (name, inline) = match body.split_once('=') {
            Some((name, v)) => (name, Some(v.to_string())),
            None => (body, None),
        };
        let opt = options
            .iter()
            .find(|o| o.name == name)
            .ok_or_else(|| format!("unknown option \"--{name}\""))?;
        let v = match (opt.takes_value, inline) {
            (true, Some(v)) => Some(v),
            (true, None) => Some(
                rest.next()
                    .cloned()
                    .ok_or_else(|| format!("option --{name} needs a value"))?,
            ),
            (false, Some(_)) => return Err(format!("option --{name} takes no value")),
            (false, None) => None,
        };
        parsed.options.insert(opt.name, v);
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_and_positionals() {
        let opts = [flag("json"), value("rank")];
        let p = parse(
            &strings(&["a.json", "--rank", "3", "--json", "b.json"]),
            &opts,
        )
        .unwrap();
        assert_eq!(p.positional, ["a.json", "b.json"]);
        assert!(p.flag("json"));
        assert_eq!(p.number::<u32>("rank").unwrap(), Some(3));
        let p = parse(&strings(&["--rank=4", "--", "--json"]), &opts).unwrap();
        assert_eq!(p.value("rank"), Some("4"));
        assert_eq!(p.positional, ["--json"]);
        assert!(!p.flag("json"));
    }

    #[test]
    fn mistakes_name_the_argument() {
        let opts = [flag("json"), value("rank")];
        assert!(parse(&strings(&["--bogus"]), &opts)
            .unwrap_err()
            .contains("--bogus"));
        assert!(parse(&strings(&["--rank"]), &opts)
            .unwrap_err()
            .contains("--rank"));
        assert!(parse(&strings(&["--json=1"]), &opts)
            .unwrap_err()
            .contains("--json"));
        let p = parse(&strings(&["--rank", "x"]), &opts).unwrap();
        assert!(p.number::<u32>("rank").unwrap_err().contains("--rank"));
    }
}
