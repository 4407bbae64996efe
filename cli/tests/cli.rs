//! Runs the built `ncclreshard` binary the way a user would: on the shipped case files, on
//! small cases with known answers, and on broken files that must fail with a message naming
//! the file and the key, never a panic.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ncclreshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ncclreshard"))
        .args(args)
        .current_dir(workspace())
        .output()
        .expect("the ncclreshard binary runs")
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Writes `text` to a fresh file under Cargo's scratch directory and returns its path.
fn scratch_file(name: &str, text: &str) -> String {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

/// The `N passed, M failed` closing line of `check`.
fn summary(out: &Output) -> (usize, usize) {
    let text = stdout(out);
    let last = text.lines().last().unwrap_or_default().to_string();
    let words: Vec<&str> = last.split_whitespace().collect();
    match words.as_slice() {
        [passed, "passed,", failed, "failed"] => (passed.parse().unwrap(), failed.parse().unwrap()),
        _ => panic!(
            "no summary line in check output:\n{text}\nstderr:\n{}",
            stderr(out)
        ),
    }
}

const NESTED: &str = r#"{"name": "nested", "shape": [10, 2], "dtype": "bfloat16",
  "src": {"mesh": [2, 2], "placements": ["Shard(0)", "Shard(0)"]},
  "dst": {"mesh": [3], "first_rank": 4, "placements": ["Shard(0)"]}}"#;

#[test]
fn every_case_file_checks() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(workspace().join("cases"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "cases/ should hold the shipped case files, found {files:?}"
    );
    for file in files {
        let path = file.to_string_lossy().into_owned();
        let out = ncclreshard(&["check", "--quiet", &path]);
        let (passed, failed) = summary(&out);
        assert!(
            out.status.success() && failed == 0 && passed > 0,
            "{path}: exit {:?}\n{}{}",
            out.status.code(),
            stdout(&out),
            stderr(&out)
        );
    }
}

#[test]
fn check_runs_every_mode_without_a_config_and_reports_staging() {
    let row_parallel = r#"{"name": "tp2-to-tp1", "shape": [64, 64], "dtype": "bfloat16",
      "src": {"mesh": [2], "placements": ["Shard(1)"]},
      "dst": {"mesh": [1], "first_rank": 2, "placements": ["Replicate"]}}"#;
    let file = scratch_file("modes.json", &format!("[{NESTED}, {row_parallel}]"));
    let out = ncclreshard(&["check", &file]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(summary(&out), (6, 0));
    let text = stdout(&out);
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("ok   {name}  ")))
            .unwrap_or_else(|| panic!("no ok line for {name}:\n{text}"))
            .to_string()
    };
    for mode in ["groupable", "staged", "auto"] {
        assert!(line(&format!("nested[{mode}]")).contains(" elements=20 "));
    }
    // Destination rows interleave both sources: groupable needs a message per row, auto
    // stages the pair into one message per source.
    assert!(
        line("tp2-to-tp1[groupable]").contains(" messages=128 staged_ranks=0 "),
        "{text}"
    );
    assert!(
        line("tp2-to-tp1[auto]").contains(" messages=2 staged_ranks=1 "),
        "{text}"
    );

    let with_mode = scratch_file(
        "one-mode.json",
        &NESTED.replace(
            r#""name": "nested","#,
            r#""name": "nested", "config": {"mode": "staged"},"#,
        ),
    );
    let out = ncclreshard(&["check", &with_mode]);
    assert_eq!(summary(&out), (1, 0));
    assert!(
        stdout(&out).starts_with("ok   nested  "),
        "{}",
        stdout(&out)
    );
}

#[test]
fn layout_json_gives_torch_indices() {
    let file = scratch_file("nested.json", NESTED);
    let out = ncclreshard(&["layout", &file, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let rows = |side: &str| -> Vec<Value> {
        json[side]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["indices"][0].clone())
            .collect()
    };
    let expected: Vec<Value> = [[0, 3], [3, 5], [5, 8], [8, 10]]
        .iter()
        .map(|r| serde_json::json!([r]))
        .collect();
    assert_eq!(rows("src"), expected);
    assert_eq!(
        rows("dst"),
        [
            serde_json::json!([[0, 4]]),
            serde_json::json!([[4, 8]]),
            serde_json::json!([[8, 10]])
        ]
    );
    let src = json["src"].as_array().unwrap();
    assert_eq!(src[1]["rank"], 1);
    assert_eq!(src[1]["coord"], serde_json::json!([0, 1]));
    assert_eq!(src[1]["shape"], serde_json::json!([2, 2]));
    assert_eq!(src[1]["indices"][1], serde_json::json!([[0, 2]]));
    assert_eq!(json["dst"][2]["rank"], 6);

    // Arrays and multi-tensor cases keep their shape.
    let multi = format!(
        r#"[{{"name": "m", "tensors": [{}, {}]}}]"#,
        NESTED.replace(r#""name": "nested", "#, ""),
        NESTED.replace(r#""name": "nested", "#, "")
    );
    let out = ncclreshard(&["layout", &scratch_file("multi.json", &multi), "--json"]);
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        json[0]["tensors"][1]["src"][3]["indices"][0],
        serde_json::json!([[8, 10]])
    );

    let out = ncclreshard(&["layout", &file]);
    assert!(out.status.success());
    assert!(stdout(&out).contains("[8,10)"), "{}", stdout(&out));
}

#[test]
fn plan_json_summarises_ranks_and_traffic() {
    let file = scratch_file("plan.json", NESTED);
    let out = ncclreshard(&["plan", &file, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let ranks = json["ranks"].as_array().unwrap();
    assert_eq!(
        ranks
            .iter()
            .map(|r| r["rank"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 5, 6]
    );
    for key in [
        "peers",
        "bytes_sent",
        "bytes_received",
        "bytes_copied_locally",
        "messages_sent",
        "messages_received",
        "mode",
        "staging_bytes",
        "fingerprint",
    ] {
        assert!(
            ranks.iter().all(|r| r.get(key).is_some()),
            "rank summaries lack {key:?}"
        );
    }
    // Rank 1 holds rows 3..5: row 3 goes to rank 4 (rows 0..4), row 4 to rank 5 (rows 4..8).
    assert_eq!(ranks[1]["peers"], serde_json::json!([4, 5]));
    assert_eq!(ranks[1]["bytes_sent"], 8);
    let traffic = json["traffic"].as_array().unwrap();
    let total: u64 = traffic.iter().map(|e| e["bytes"].as_u64().unwrap()).sum();
    assert_eq!(total, 10 * 2 * 2, "every element crosses once");
    assert!(traffic
        .iter()
        .any(|e| e["from"] == 1 && e["to"] == 4 && e["bytes"] == 4));
    assert!(traffic.iter().all(|e| e["bytes"].as_u64().unwrap() > 0));

    let out = ncclreshard(&["plan", &file, "--rank", "5", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["rank"], 5);
    assert_eq!(json["bytes_received"], 16);
    assert_eq!(json["mode"], "groupable");
    assert_eq!(json["peers"], serde_json::json!([1, 2]));

    let out = ncclreshard(&["plan", &file, "--mode", "auto"]);
    assert!(out.status.success());
    assert!(stdout(&out).contains("mode auto"), "{}", stdout(&out));
}

#[test]
fn bench_plan_reports_timings() {
    let out = ncclreshard(&[
        "bench-plan",
        "--tensors",
        "3",
        "--src-mesh",
        "2,2",
        "--dst-mesh",
        "2,2",
        "--shape",
        "64,32",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["tensors"], 3);
    assert_eq!(json["ranks"], 8);
    assert!(json["messages_total"].as_u64().unwrap() > 0);
    for key in ["plan_ms_one_rank", "plan_ms_all_ranks"] {
        assert!(json[key].as_f64().unwrap() >= 0.0, "{key}");
    }
}

/// A broken file must exit 2 with a message that names the file and the key, and never panic.
fn assert_rejected(name: &str, text: &str, needles: &[&str]) {
    let path = scratch_file(name, text);
    for command in ["check", "layout", "plan"] {
        let out = ncclreshard(&[command, &path]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{command} {name}: {err}");
        assert!(
            !err.contains("panicked"),
            "{command} {name} panicked: {err}"
        );
        assert!(
            err.contains(&path),
            "{command} {name}: message does not name the file: {err}"
        );
        for needle in needles {
            assert!(
                err.contains(needle),
                "{command} {name}: message lacks {needle:?}: {err}"
            );
        }
    }
}

#[test]
fn bad_files_name_the_path_and_key() {
    let good_side = r#"{"mesh": [2], "placements": ["Shard(0)"]}"#;
    let case = |extra_src: &str, dtype: &str| {
        format!(
            r#"[{NESTED}, {{"name": "bad", "shape": [4, 4], "dtype": "{dtype}", "src": {extra_src}, "dst": {good_side}}}]"#
        )
    };
    assert_rejected(
        "unknown-key.json",
        &case(
            r#"{"mesh": [2], "placements": ["Shard(0)"], "colour": "red"}"#,
            "float32",
        ),
        &[r#"case 1 ("bad")"#, "src.colour", "unknown key"],
    );
    assert_rejected(
        "bad-placement.json",
        &case(
            r#"{"mesh": [2, 2], "placements": ["Replicate", "Shard(x)"]}"#,
            "float32",
        ),
        &[r#"case 1 ("bad")"#, "src.placements[1]", "Shard(x)"],
    );
    assert_rejected(
        "partial.json",
        &case(r#"{"mesh": [2], "placements": ["Partial"]}"#, "float32"),
        &["src.placements[0]", "Partial"],
    );
    assert_rejected(
        "bad-dtype.json",
        &case(good_side, "bfloat17"),
        &[r#"case 1 ("bad")"#, "dtype", "bfloat17"],
    );
    assert_rejected(
        "mesh-ranks-mismatch.json",
        &case(
            r#"{"mesh": [2, 2], "ranks": [0, 1, 2], "placements": ["R", "R"]}"#,
            "float32",
        ),
        &["src.ranks", "4 ranks", "3"],
    );
    assert_rejected(
        "placements-count.json",
        &case(r#"{"mesh": [2, 2], "placements": ["Shard(0)"]}"#, "float32"),
        &[r#"case 1 ("bad")"#, "src", "placements"],
    );
    assert_rejected(
        "dim-out-of-range.json",
        &case(r#"{"mesh": [2], "placements": ["Shard(5)"]}"#, "float32"),
        &["src", "dim 5"],
    );
    assert_rejected(
        "wrong-type.json",
        &case(
            r#"{"mesh": [2, "two"], "placements": ["R", "R"]}"#,
            "float32",
        ),
        &["src.mesh[1]", "\"two\""],
    );
    assert_rejected(
        "missing-key.json",
        r#"{"name": "m", "shape": [4], "dtype": "int8", "src": {"mesh": [2], "placements": ["R"]}}"#,
        &["dst", "missing"],
    );
    assert_rejected(
        "bad-mode.json",
        &NESTED.replace(
            r#""name": "nested","#,
            r#""name": "nested", "config": {"mode": "fast"},"#,
        ),
        &["config.mode", "fast"],
    );
    assert_rejected(
        "bad-tensor-in-plan.json",
        r#"{"name": "m", "tensors": [{"shape": [4], "dtype": "int8",
            "src": {"mesh": [2], "placements": ["R"]}, "dst": {"mesh": [2], "placements": ["S(0)"], "strides": [1, 1]}}]}"#,
        &["tensors[0]", "strides"],
    );
    assert_rejected(
        "malformed.json",
        "[{\"name\": \"x\", \"shape\": [4,",
        &["malformed JSON", "line 1"],
    );
    assert_rejected("empty.json", "[]", &["no cases"]);
}

#[test]
fn missing_file_and_usage_errors_exit_2() {
    let out = ncclreshard(&["check", "no/such/file.json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no/such/file.json"),
        "{}",
        stderr(&out)
    );
    for args in [
        &["check"][..],
        &["frobnicate"],
        &["plan", "a.json", "b.json"],
        &["plan", "--rank"],
        &["check", "--bogus", "x.json"],
        &["bench-plan", "--src-mesh", "2,x", "--dst-mesh", "2"],
        &["bench-plan", "--dst-mesh", "2"],
    ] {
        let out = ncclreshard(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("error:"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert!(
            !stderr(&out).contains("panicked"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn help_and_version() {
    let out = ncclreshard(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        stdout(&out).trim(),
        format!("ncclreshard {}", env!("CARGO_PKG_VERSION"))
    );
    let out = ncclreshard(&["--help"]);
    assert!(out.status.success());
    for command in ["check", "layout", "plan", "bench-plan"] {
        assert!(
            stdout(&out).contains(command),
            "top-level help lacks {command}"
        );
        for args in [vec![command, "--help"], vec!["help", command]] {
            let out = ncclreshard(&args);
            assert!(out.status.success(), "{args:?}");
            assert!(
                stdout(&out).contains(&format!("ncclreshard {command}")),
                "{args:?}: {}",
                stdout(&out)
            );
        }
    }
}
