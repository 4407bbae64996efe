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

/// The `N passed, M failed[, K refused]` closing line of `check` (passed, failed).
fn summary(out: &Output) -> (usize, usize) {
    let text = stdout(out);
    let last = text.lines().last().unwrap_or_default().to_string();
    let words: Vec<&str> = last.split_whitespace().collect();
    match words.as_slice() {
        [passed, "passed,", failed, "failed"]
        | [passed, "passed,", failed, "failed,", _, "refused"] => {
            (passed.parse().unwrap(), failed.parse().unwrap())
        }
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

#[test]
fn execute_runs_the_callers_bytes_and_writes_the_destinations() {
    // [4] float32 over ranks 0-1 (two elements each) -> rank 2 whole, in a strided view
    // (every element followed by a gap element the executor must leave alone).
    let case = scratch_file(
        "execute.json",
        r#"{"name": "gather", "shape": [4], "dtype": "float32", "config": {"mode": "staged"},
            "src": {"mesh": [2], "placements": ["Shard(0)"]},
            "dst": {"mesh": [1], "first_rank": 2, "placements": ["Replicate"], "strides": [2]}}"#,
    );
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-tests/execute");
    let (input, output) = (dir.join("in"), dir.join("out"));
    std::fs::create_dir_all(&input).unwrap();
    let floats = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    std::fs::write(input.join("0.src.0"), floats(&[1.0, 2.0])).unwrap();
    std::fs::write(input.join("1.src.0"), floats(&[3.0, 4.0])).unwrap();
    // The destination's extent: 7 elements (4 values, 3 gaps between them).
    std::fs::write(input.join("2.dst.0"), floats(&[-1.0; 7])).unwrap();
    let args = |input: &Path| {
        vec![
            "execute".to_string(),
            case.clone(),
            "--input".to_string(),
            input.to_string_lossy().into_owned(),
            "--output".to_string(),
            output.to_string_lossy().into_owned(),
        ]
    };
    let run = |args: Vec<String>| ncclreshard(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let out = run(args(&input));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("executed gather  ranks=3 bytes_in=44 bytes_out=28"),
        "{}",
        stdout(&out)
    );
    let got = std::fs::read(output.join("2.dst.0")).unwrap();
    assert_eq!(got, floats(&[1.0, -1.0, 2.0, -1.0, 3.0, -1.0, 4.0]));

    // A view of the wrong size, and a missing one: exit 2 naming the file.
    std::fs::write(input.join("1.src.0"), floats(&[3.0])).unwrap();
    let out = run(args(&input));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("1.src.0: 4 bytes; the view's extent is 8"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_file(input.join("1.src.0")).unwrap();
    let out = run(args(&input));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("1.src.0: cannot read"),
        "{}",
        stderr(&out)
    );
    let out = ncclreshard(&["execute", &case, "--input", "x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--output DIR is required"),
        "{}",
        stderr(&out)
    );
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
    for command in [
        "check",
        "execute",
        "layout",
        "plan",
        "simulate",
        "calibrate",
        "refit",
        "bench",
        "bench-plan",
    ] {
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

// ---------------------------------------------------------------------------------------
// Model refits: simulate, refit, bench

/// A tiny dense model as a HuggingFace config.json: two layers, so two pipeline stages.
const TINY_CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "vocab_size": 100}"#;

fn json_of(out: &Output) -> Value {
    serde_json::from_str(&stdout(out))
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}\nstderr:\n{}", stdout(out), stderr(out)))
}

#[test]
fn simulate_rank_breaks_down_the_rank_asked_for() {
    let run = |extra: &[&str]| {
        let args = [
            "simulate", "--model", "dsv3-toy", "--train", "pp1,ep8", "--infer", "tp8", "--trials",
            "0", "--json",
        ];
        ncclreshard(&[&args[..], extra].concat())
    };
    let last = run(&[]);
    assert!(last.status.success(), "{}", stderr(&last));
    let last = json_of(&last);
    // A training rank: its own clock, which ends no later than the run does.
    let out = run(&["--rank", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    let critical = &json["critical_path"];
    assert_eq!(critical["rank"], 3, "{critical}");
    let nominal = critical["nominal_s"].as_f64().unwrap();
    let run_s = last["reshard_s"].as_f64().unwrap();
    assert!(
        nominal > 0.0 && nominal <= run_s + 1e-12,
        "{nominal} > {run_s}"
    );
    assert_eq!(json["reshard_s"], last["reshard_s"]);
    assert!(!critical["rounds"].as_array().unwrap().is_empty());
    // Not a rank of the refit: a usage error naming the ranks there are.
    let out = run(&["--rank", "16"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("--rank 16") && err.contains("0 to 15"),
        "{err}"
    );
}

#[test]
fn simulate_sender_barrier_switches_the_senders_barrier_on_and_off() {
    // One DGX node's 8 training GPUs only send: `on` puts all 8 in one barrier, `off` and
    // `auto` (fewer than 9 on the node) none.
    let run = |extra: &[&str]| {
        let args = [
            "simulate", "--model", "dsv3-toy", "--train", "pp1,ep8", "--infer", "tp8", "--rounds",
            "4", "--trials", "0", "--json",
        ];
        ncclreshard(&[&args[..], extra].concat())
    };
    for (setting, members) in [("on", 8), ("off", 0), ("auto", 0)] {
        let out = run(&["--sender-barrier", setting]);
        assert!(out.status.success(), "{setting}: {}", stderr(&out));
        let json = json_of(&out);
        assert_eq!(json["sender_barrier"], setting);
        assert_eq!(json["barrier_members_max"], members, "{setting}");
        assert!(json["reshard_s"].as_f64().unwrap() > 0.0, "{setting}");
        let waited = json["critical_path"]["waits_barrier_s"].as_f64().unwrap();
        assert!(
            waited >= 0.0 && (members > 0 || waited == 0.0),
            "{setting}: {waited}"
        );
    }
    // The default is auto.
    let json = json_of(&run(&[]));
    assert_eq!(json["sender_barrier"], "auto");
    assert_eq!(json["barrier_members_max"], 0);
    // Anything else: a usage error naming the flag.
    let out = run(&["--sender-barrier", "sometimes"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("--sender-barrier") && err.contains("sometimes"),
        "{err}"
    );
}

#[test]
fn simulate_json_reports_every_method_the_floors_and_the_costs() {
    let out = ncclreshard(&[
        "simulate", "--model", "dsv3-toy", "--train", "pp1,ep8", "--infer", "tp8", "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    for key in [
        "reshard_s",
        "reshard_p90_s",
        "m2n_hierarchical_s",
        "m2n_direct_s",
        "m2n_hierarchical_one_comm_s",
        "gather_broadcast_s",
        "lower_bound_s",
        "direct_bound_s",
        "setup_s",
        "peak_staging_bytes",
        "bytes_total",
        "messages_max_per_rank",
        "messages_mean_per_rank",
        "model_bytes",
    ] {
        let v = json[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {json}"));
        assert!(v > 0.0, "{key} = {v}");
    }
    assert!(json["messages_max_per_rank"].is_u64());
    assert_eq!(json["ranks"], 16);
    assert_eq!(json["cluster"]["name"], "dgx-h100");
    // Physics: no plan beats the floor, and every byte of the model reaches the 8 inference
    // ranks' shards at least once.
    let (reshard, bound) = (
        json["reshard_s"].as_f64().unwrap(),
        json["lower_bound_s"].as_f64().unwrap(),
    );
    assert!(reshard >= bound * (1.0 - 1e-9), "{reshard} < {bound}");
    assert!(json["direct_bound_s"].as_f64().unwrap() >= bound);
    assert!(json["reshard_p90_s"].as_f64().unwrap() >= reshard);
    assert_eq!(json["trials"], 5);
    assert_eq!(json["fits"], true);
    for peer in ["m2n_hierarchical_s", "m2n_direct_s", "gather_broadcast_s"] {
        assert!(
            json[peer].as_f64().unwrap() >= bound * (1.0 - 1e-9),
            "{peer}"
        );
    }
    // The engine post-processing is charged to every method alike.
    let post = &json["with_engine_postprocess"];
    let charge = post["engine_postprocess_s"].as_f64().unwrap();
    assert!(charge > 0.0);
    assert!(
        (post["reshard_s"].as_f64().unwrap() - reshard - charge).abs() < 1e-9
            && (post["gather_broadcast_s"].as_f64().unwrap()
                - json["gather_broadcast_s"].as_f64().unwrap()
                - charge)
                .abs()
                < 1e-9
    );
    assert!(json["bytes_total"].as_u64().unwrap() >= json["model_bytes"].as_u64().unwrap());
    assert!(json["busiest_link"]["busy_fraction"].as_f64().unwrap() > 0.0);
    // NIC bytes per side: the 8 training ranks send over their NICs and the 8 inference ranks
    // (another node) take in every byte that crossed nodes; none exceeds the busiest link.
    let nic = &json["nic_bytes"];
    let side = |s: &str, d: &str, k: &str| nic[s][d][k].as_f64().unwrap_or_else(|| panic!("{nic}"));
    assert!(side("train", "egress", "min") > 0.0 && side("train", "ingress", "max") == 0.0);
    let offnode = json["bytes_offnode"].as_f64().unwrap();
    assert!(
        (side("infer", "ingress", "mean") * 8.0 - offnode).abs() <= 8.0,
        "{nic} {offnode}"
    );
    let busiest = json["busiest_link"]["bytes"].as_f64().unwrap();
    for s in ["train", "infer"] {
        for d in ["egress", "ingress"] {
            assert!(
                side(s, d, "min") <= side(s, d, "mean") && side(s, d, "mean") <= side(s, d, "max")
            );
            assert!(side(s, d, "max") <= busiest, "{nic}");
        }
    }
    // Each round's busiest link: in round order, none longer than the busiest link's whole
    // load, and summing to `lockstep_s` (at least that whole load, or one link would carry
    // more than its bytes).
    let profile = &json["rounds_profile"];
    let rounds = profile["rounds"].as_array().unwrap();
    let total = profile["busiest_total_s"].as_f64().unwrap();
    let lockstep = profile["lockstep_s"].as_f64().unwrap();
    assert!(!rounds.is_empty() && total > 0.0, "{profile}");
    let seconds: Vec<f64> = rounds
        .iter()
        .map(|r| r["seconds"].as_f64().unwrap())
        .collect();
    assert!(
        seconds.iter().all(|&s| s > 0.0 && s <= total + 1e-12),
        "{profile}"
    );
    assert!((seconds.iter().sum::<f64>() - lockstep).abs() < 1e-9 && lockstep >= total - 1e-12);
    assert!((profile["unevenness_s"].as_f64().unwrap() - (lockstep - total)).abs() < 1e-9);
    assert!(rounds
        .windows(2)
        .all(|w| w[0]["round"].as_u64() < w[1]["round"].as_u64()));
    // Where the time goes: the sharing term splits into waiting for peers and the rest.
    let critical = &json["critical_path"];
    let part = |k: &str| {
        critical[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k}: {critical}"))
    };
    let (sharing, peers, links) = (
        part("transfers_sharing_s"),
        part("transfers_sharing_peers_s"),
        part("transfers_sharing_links_s"),
    );
    assert!(peers >= 0.0 && links >= 0.0, "{critical}");
    assert!((peers + links - sharing).abs() < 1e-9, "{critical}");
    // Round by round: ascending rounds, each entered when the one before was done and
    // unpacked, its transfers summing to the rank's, the peer it waited for never a
    // negative wait.
    let by_round = critical["rounds"].as_array().unwrap();
    assert!(!by_round.is_empty(), "{critical}");
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
    let mut transfers = 0.0;
    for (at, r) in by_round.iter().enumerate() {
        assert!(
            f(r, "entered_s") <= f(r, "ready_s") && f(r, "ready_s") <= f(r, "done_s"),
            "{r}"
        );
        assert!(
            (f(r, "done_s") - f(r, "ready_s") - f(r, "transfers_s")).abs() < 1e-12,
            "{r}"
        );
        assert!(
            f(r, "last_peer_after_s") >= 0.0 && f(r, "own_s") >= 0.0,
            "{r}"
        );
        assert_eq!(
            r["last_peer"].is_null(),
            r["flows"].as_u64() == Some(0),
            "{r}"
        );
        transfers += f(r, "transfers_s");
        if let Some(next) = by_round.get(at + 1) {
            assert!(r["round"].as_u64() < next["round"].as_u64(), "{critical}");
            let left = f(r, "done_s") + f(r, "unpack_s");
            assert!(
                (f(next, "entered_s") - left).abs() < 1e-9,
                "{r} then {next}"
            );
        }
    }
    assert!((transfers - part("transfers_s")).abs() < 1e-9, "{critical}");

    // The text form names every method; a custom cluster is taken.
    let toy = |cluster: &str, json: &[&str]| {
        let args = [
            "simulate",
            "--model",
            "dsv3-toy",
            "--train",
            "pp1,ep8",
            "--infer",
            "tp8",
            "--cluster",
            cluster,
        ];
        ncclreshard(&[&args[..], json].concat())
    };
    let out = toy("gb200-nvl72,nic_gbits=200", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for needle in [
        "reshard (ncclreshard)",
        "M2N hierarchical",
        "M2N direct",
        "gather+broadcast",
        "floor",
        "direct-plan bound",
        "with engine post-processing",
        "setup (once)",
        "busiest link",
        "gb200-nvl72",
    ] {
        assert!(text.contains(needle), "lacks {needle:?}:\n{text}");
    }

    // A GPU with 10 MB free holds neither the staging nor NCCL's buffers: the reshard is
    // reported, not simulated; the other methods still are.
    let out = toy("dgx-h100,free_memory_gb=0.01", &["--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    assert_eq!(json["fits"], false);
    assert!(json["reshard_s"].is_null());
    assert!(json["peak_staging_bytes"].as_u64().unwrap() > 0);
    assert!(json["m2n_hierarchical_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn calibrate_compares_every_published_measurement() {
    let out = ncclreshard(&["calibrate", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = json_of(&out);
    let rows = rows.as_array().expect("an array of rows");
    assert!(rows.len() >= 9);
    for row in rows {
        let (published, simulated, ratio) = (
            row["published_s"].as_f64().unwrap(),
            row["simulated_s"].as_f64().unwrap(),
            row["ratio"].as_f64().unwrap(),
        );
        assert!(row["name"].is_string());
        assert!((ratio - simulated / published).abs() < 1e-9, "{row}");
        assert_eq!(row["within_25_percent"], (ratio - 1.0).abs() <= 0.25);
    }
    for name in [
        "NeMo RL gather+broadcast, DeepSeek-V3, 256+256 H100",
        "M2N reshard_model_bench hierarchical, DeepSeek-V3, 256 GB200",
        "M2N reshard_model_bench direct, Qwen3-235B, 128 GB200",
    ] {
        assert!(rows.iter().any(|r| r["name"] == name), "no row {name:?}");
    }
    let out = ncclreshard(&["calibrate"]);
    let text = stdout(&out);
    assert!(text.contains("rows within ±25 %"), "{text}");
    assert!(text.contains("14.21–15.52 s"), "{text}");
}

/// A minimal XML well-formedness check: tags nest and close, attribute quotes pair up and
/// every `&` starts an entity.
fn assert_well_formed_xml(text: &str) {
    let mut open: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('<') {
        let body_text = &rest[..start];
        assert!(
            body_text
                .match_indices('&')
                .all(|(i, _)| body_text[i..].starts_with("&amp;")
                    || body_text[i..].starts_with("&lt;")
                    || body_text[i..].starts_with("&gt;")
                    || body_text[i..].starts_with("&quot;")),
            "bare & in text {body_text:?}"
        );
        let end = rest[start..].find('>').expect("every tag closes") + start;
        let tag = &rest[start + 1..end];
        rest = &rest[end + 1..];
        assert_eq!(
            tag.matches('"').count() % 2,
            0,
            "unbalanced quotes in <{tag}>"
        );
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                open.pop().as_deref(),
                Some(name.trim()),
                "misnested </{name}>"
            );
        } else if !tag.ends_with('/') {
            open.push(tag.split_whitespace().next().unwrap().to_string());
        }
    }
    assert!(open.is_empty(), "unclosed tags {open:?}");
}

#[test]
fn refit_runs_verifies_and_draws_the_traffic() {
    let svg = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-tests/refit.svg");
    std::fs::create_dir_all(svg.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&svg);
    let out = ncclreshard(&[
        "refit",
        "--model",
        "qwen3-32b",
        "--train",
        "tp4,pp4,dp2",
        "--infer",
        "tp4,dp8",
        "--scale",
        "64",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", stderr(&out));
    for needle in [
        "Host run: qwen3-32b/64",
        "ranks                   64 (32 train, 32 infer)",
        "every byte OK",
        "gather+broadcast bytes",
        "Simulated (not measured) at full size: qwen3-32b",
        "reshard (ncclreshard)",
        "M2N hierarchical",
        "floor",
    ] {
        assert!(text.contains(needle), "lacks {needle:?}:\n{text}");
    }

    let picture = std::fs::read_to_string(&svg).expect("--svg writes the file");
    assert!(picture.starts_with("<?xml"), "{}", &picture[..100]);
    assert_well_formed_xml(&picture);
    assert!(picture.contains("qwen3-32b refit: train tp4,pp4,dp2 → infer tp4,dp8"));
    assert!(picture.contains("train tp4,pp4,dp2 (ranks 0-31)"));
    assert!(picture.contains("infer tp4,dp8 (ranks 32-63)"));
    // One cell per communicating pair: training ranks send to inference ranks, inference
    // ranks relay to replicas on their own node, and forward part of what the first and last
    // pipeline stages send (their nodes also hold the embedding and the LM head, so they send
    // more than a receiving node takes in) to other inference nodes; nothing else communicates.
    let pairs: Vec<(u32, u32)> = picture
        .split("<title>rank ")
        .skip(1)
        .filter_map(|cell| {
            let (from, rest) = cell.split_once(" → ")?;
            let to = rest.split(':').next()?;
            Some((from.parse().ok()?, to.parse().ok()?))
        })
        .collect();
    assert!(pairs.contains(&(0, 32)) || pairs.iter().any(|&(f, _)| f == 0));
    assert!(pairs.iter().any(|&(f, t)| f < 32 && t >= 32));
    assert!(
        pairs.iter().any(|&(f, t)| f >= 32 && f / 8 == t / 8),
        "relays on an inference node"
    );
    assert!(
        pairs.iter().any(|&(f, t)| f >= 32 && f / 8 != t / 8),
        "forwards between inference nodes"
    );
    for (from, to) in pairs {
        assert!(to >= 32, "rank {from} → {to}: only inference ranks receive");
    }
}

#[test]
fn refit_of_a_config_file_colocated_as_json() {
    let model = scratch_file("tiny-config.json", TINY_CONFIG);
    let out = ncclreshard(&[
        "refit",
        "--model",
        &model,
        "--train",
        "tp2,pp2",
        "--infer",
        "tp2,dp2",
        "--colocated",
        "--scale",
        "1",
        "--mode",
        "groupable",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let json = json_of(&out);
    let host = &json["host"];
    assert_eq!(host["verified"], true);
    assert_eq!(host["ranks"], 4);
    assert_eq!(host["staged_ranks"], 0, "groupable mode never stages");
    assert!(host["elements_verified"].as_u64().unwrap() > 0);
    // Colocated: each rank's own overlap is a local copy, not a message.
    assert!(host["bytes_local"].as_u64().unwrap() > 0);
    assert!(
        host["gather_broadcast_bytes"].as_u64().unwrap() > host["bytes_moved"].as_u64().unwrap()
    );
    assert!(json["simulated"]["lower_bound_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_measures_plan_exec_and_copy() {
    let model = scratch_file("tiny-bench.json", TINY_CONFIG);
    let spec = [
        "--model",
        &model,
        "--train",
        "tp2,pp2,dp2",
        "--infer",
        "tp4,dp2",
    ];
    let out = ncclreshard(&[&["bench", "--plan", "--json"][..], &spec].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    assert_eq!(json["ranks"], 16);
    for key in [
        "plan_ms_one_rank",
        "plan_ms_all_ranks",
        "plan_ms_all_ranks_cpu",
    ] {
        assert!(json[key].as_f64().unwrap() > 0.0, "{key}: {json}");
    }
    assert!(json["plan_ms_all_ranks"].as_f64() >= json["plan_ms_new"].as_f64());
    if cfg!(target_os = "linux") {
        assert!(json["peak_rss_mb"].as_f64().unwrap() > 1.0, "{json}");
    }

    // --rank: given ranks alone, with their messages; a rank outside the refit is refused.
    let out = ncclreshard(
        &[
            &[
                "bench", "--plan", "--rank", "0,9", "--repeat", "2", "--json",
            ][..],
            &spec,
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let alone = json_of(&out)["ranks_alone"].clone();
    assert_eq!(alone.as_array().map(Vec::len), Some(2), "{alone}");
    for (entry, rank) in alone.as_array().unwrap().iter().zip([0, 9]) {
        assert_eq!(entry["rank"], rank);
        assert!(entry["plan_ms"].as_f64().unwrap() > 0.0, "{entry}");
        assert!(entry["messages"].as_u64().unwrap() > 0, "{entry}");
    }
    // --infer-dtype: the refit that converts on the way is planned (Qwen3-32B TP4·PP2 → TP4:
    // every decoder linear weight to FP8 blocks; fewer bytes than the same refit in BF16).
    let qwen = [&["bench", "--plan"][..], &QWEN_TP4_PP2_TO_TP4, &["--json"]].concat();
    let plain = json_of(&ncclreshard(&qwen));
    let out = ncclreshard(&[&qwen[..], &["--infer-dtype", "fp8-block128"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let fp8 = json_of(&out);
    assert_eq!(fp8["infer_dtype"], "fp8-block128");
    assert_eq!(fp8["converted_tensors"], 64 * 7, "{fp8}");
    assert_eq!(
        (
            plain["infer_dtype"].clone(),
            plain["converted_tensors"].clone()
        ),
        ("bfloat16".into(), 0.into())
    );
    assert!(
        fp8["bytes_total"].as_u64().unwrap() < plain["bytes_total"].as_u64().unwrap() * 6 / 10,
        "FP8 moves fewer bytes: {fp8} {plain}"
    );
    let out = ncclreshard(&[&["bench", "--plan", "--rank", "16"][..], &spec].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--rank: 16 is not a rank"),
        "{}",
        stderr(&out)
    );

    let out = ncclreshard(&[&["bench", "--exec", "--scale", "1", "--json"][..], &spec].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    assert_eq!(json["results_match"], true);
    // Two inference replicas of TP4 each need every byte; the baseline also ships whole
    // tensors to ranks that keep a quarter of them.
    let (reshard, baseline) = (
        json["reshard_bytes"].as_u64().unwrap(),
        json["gather_broadcast_bytes"].as_u64().unwrap(),
    );
    assert!(
        reshard > 0 && baseline > 2 * reshard,
        "{reshard} vs {baseline}"
    );
    assert!(json["reshard_s"].as_f64().unwrap() > 0.0);
    assert!(json["gather_broadcast_s"].as_f64().unwrap() > 0.0);

    let out = ncclreshard(&["bench", "--copy", "--mib", "4", "--repeat", "2", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    assert_eq!(json["bytes"], 4 << 20);
    assert_eq!(json["stride_bytes"], 4096 + 64);
    for key in [
        "memcpy_gbs",
        "pack_gbs",
        "unpack_gbs",
        "contiguous_gbs",
        "pack_over_memcpy",
    ] {
        assert!(json[key].as_f64().unwrap() > 0.0, "{key}: {json}");
    }
}

#[test]
fn model_command_mistakes_exit_2_with_a_message() {
    let spec = ["--train", "tp4,pp4,dp2", "--infer", "tp4,dp8"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["simulate", "--train", "pp2", "--infer", "tp2"],
            "--model is required",
        ),
        (
            vec!["simulate", "--model", "qwen3-32b", "--infer", "tp2"],
            "--train is required",
        ),
        (
            vec![
                "simulate", "--model", "gpt-9", "--train", "pp2", "--infer", "tp2",
            ],
            "gpt-9",
        ),
        (
            vec![
                "simulate",
                "--model",
                "qwen3-32b",
                "--train",
                "tp0",
                "--infer",
                "tp2",
            ],
            "--train",
        ),
        (
            vec![
                "simulate",
                "--model",
                "qwen3-32b",
                "--train",
                "pp2",
                "--infer",
                "tp2,zz3",
            ],
            "--infer",
        ),
        (
            [
                &["simulate", "--model", "qwen3-32b", "--cluster", "dgx-a100"][..],
                &spec,
            ]
            .concat(),
            "--cluster",
        ),
        (
            [
                &[
                    "simulate",
                    "--model",
                    "qwen3-32b",
                    "--cluster",
                    "dgx-h100,nic_gbs=x",
                ][..],
                &spec,
            ]
            .concat(),
            "nic_gbs",
        ),
        (
            [
                &["simulate", "--model", "qwen3-32b", "--mode", "fast"][..],
                &spec,
            ]
            .concat(),
            "--mode",
        ),
        (
            [
                &["simulate", "--model", "qwen3-32b", "--experts", "some"][..],
                &spec,
            ]
            .concat(),
            "--experts",
        ),
        (
            [
                &["simulate", "--model", "qwen3-32b", "--dtype", "bfloat17"][..],
                &spec,
            ]
            .concat(),
            "bfloat17",
        ),
        (
            [
                &["simulate", "--model", "qwen3-32b", "--system", "x.json"][..],
                &spec,
            ]
            .concat(),
            "--system",
        ),
        (
            [&["simulate", "--model", "qwen3-32b", "--bogus"][..], &spec].concat(),
            "--bogus",
        ),
        (
            [
                &["simulate", "--model", "qwen3-32b", "--trials", "many"][..],
                &spec,
            ]
            .concat(),
            "--trials",
        ),
        ([&["calibrate", "extra.json"][..]].concat(), "takes no FILE"),
        (
            [
                &["refit", "--model", "qwen3-32b", "--scale", "0"][..],
                &spec,
            ]
            .concat(),
            "--scale",
        ),
        (
            [
                &["refit", "--model", "qwen3-32b", "--scale", "x"][..],
                &spec,
            ]
            .concat(),
            "--scale",
        ),
        (
            [&["refit", "--model", "qwen3-32b", "--svg="][..], &spec].concat(),
            "--svg",
        ),
        (
            [
                &["refit", "--model", "qwen3-32b", "--scale", "1"][..],
                &spec,
            ]
            .concat(),
            "raise --scale",
        ),
        (
            [
                &[
                    "refit",
                    "--model",
                    "qwen3-32b",
                    "--svg",
                    "no/such/dir/x.svg",
                ][..],
                &spec,
            ]
            .concat(),
            "cannot write",
        ),
        (vec!["bench"], "--plan, --exec or --copy"),
        (vec!["bench", "--plan", "--copy"], "one per run"),
        (
            vec!["bench", "--copy", "--infer-dtype", "fp8-block128"],
            "--infer-dtype is an option of --plan",
        ),
        (vec!["bench", "--copy", "--row", "3000"], "--row"),
        (
            vec!["bench", "--plan", "--model", "qwen3-32b"],
            "--train is required",
        ),
    ];
    for (args, needle) in cases {
        let out = ncclreshard(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("error:") && err.contains(needle),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(stdout(&out).is_empty(), "{args:?} printed to stdout");
    }
}

/// A small refit whose decoder linear weights quantize to FP8 128×128 blocks (both layouts
/// hold whole blocks): Qwen3-32B from TP4·PP2 (8 ranks) to TP4 (4 ranks).
const QWEN_TP4_PP2_TO_TP4: [&str; 6] = [
    "--model",
    "qwen3-32b",
    "--train",
    "tp4,pp2",
    "--infer",
    "tp4",
];

#[test]
fn simulate_json_says_how_much_senders_convert_before_their_first_round() {
    // Qwen3-32B TP4·PP2 → TP4 to FP8 blocks: the 8 training ranks convert; the report gives
    // the share of their conversions their first rounds read, over all of them and on the
    // sender where it is largest, and names that sender.
    let out = ncclreshard(
        &[
            &["simulate"][..],
            &QWEN_TP4_PP2_TO_TP4,
            &["--infer-dtype", "fp8-block128", "--trials", "0", "--json"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let json = json_of(&out);
    let c = &json["conversion"];
    assert_eq!(c["converted_tensors"], 64 * 7, "{c}");
    let (share, max) = (
        c["first_round_share"].as_f64().unwrap(),
        c["first_round_share_max"].as_f64().unwrap(),
    );
    assert!(0.0 < share && share <= max && max <= 1.0, "{c}");
    let rank = c["first_round_share_rank"].as_u64().unwrap();
    assert!(rank < 8, "a training rank: {c}");
    assert!(c["bytes_saved"].as_i64().unwrap() > 0, "{c}");
}

#[test]
fn refit_quantizes_to_fp8_blocks_on_the_way_and_moves_fewer_bytes() {
    let run = |extra: &[&str]| -> Value {
        let mut args = vec![
            "refit",
            "--model",
            "qwen3-32b",
            "--train",
            "pp4",
            "--infer",
            "tp2,dp2",
            "--scale",
            "128",
            "--no-simulate",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = ncclreshard(&args);
        assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
        serde_json::from_str(&stdout(&out)).unwrap()
    };
    let plain = run(&[]);
    let fp8 = run(&["--infer-dtype", "fp8-block128"]);
    assert_eq!(fp8["host"]["verified"], true, "{fp8}");
    assert_eq!(fp8["host"]["infer_dtype"], "fp8-block128");
    // Every decoder linear weight: q, k, v, o, gate, up, down per layer.
    assert_eq!(fp8["host"]["converted_tensors"], 64 * 7);
    let bytes = |v: &Value| v["host"]["bytes_moved"].as_u64().unwrap();
    assert!(
        bytes(&fp8) < bytes(&plain) * 6 / 10,
        "{} vs {}",
        bytes(&fp8),
        bytes(&plain)
    );
    let out = ncclreshard(&[
        "refit",
        "--model",
        "qwen3-32b",
        "--train",
        "pp4",
        "--infer",
        "tp2",
        "--infer-dtype",
        "fp8-blockx",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--infer-dtype"), "{}", stderr(&out));
}
