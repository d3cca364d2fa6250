//! `mla-bench serve` end to end against a scripted server (tests/mock): vLLM's flags and result
//! file, the test request first, the API key, keep-alive, https, the vocabulary learnt from the
//! server, the exit status when requests fail, and the earlier flag spellings.

mod mock;

use mock::{Behaviour, Mock};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mla-bench-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn bench(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mla-bench"));
    c.arg("serve").args(args).env_remove("OPENAI_API_KEY").env_remove("SSL_CERT_FILE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn generations(m: &Mock) -> Vec<mock::Seen> {
    m.seen()
        .into_iter()
        .filter(|s| s.method == "POST" && s.body["max_tokens"].as_u64() != Some(1) || s.path.contains("chat"))
        .collect()
}

#[test]
fn a_vllm_command_line_runs_and_writes_vllms_result() {
    let m = Mock::start(Behaviour::default());
    let dir = tmp("vllm");
    let url = m.url();
    let o = bench(
        &[
            "--backend",
            "openai",
            "--base-url",
            &url,
            "--dataset-name",
            "random",
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            "--num-prompts",
            "6",
            "--max-concurrency",
            "2",
            "--request-rate",
            "200",
            "--burstiness",
            "2",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,99",
            "--goodput",
            "ttft:5000",
            "tpot:5000",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            dir.to_str().unwrap(),
            "--result-filename",
            "r.json",
            "--metadata",
            "run=t1",
            "--disable-tqdm",
        ],
        &[("OPENAI_API_KEY", "sk-test")],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    for row in
        ["Successful requests:                     6", "Request goodput (req/s):", "P50 E2EL (ms):", "Mean TPOT (ms):"]
    {
        assert!(out.contains(row), "{row} missing:\n{out}");
    }
    let r = read_json(&dir.join("r.json"));
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64(), r["backend"].as_str()),
        (Some(6), Some(0), Some("openai"))
    );
    assert_eq!(
        (r["model_id"].as_str(), r["run"].as_str(), r["max_concurrency"].as_u64()),
        (Some("mock-model"), Some("t1"), Some(2))
    );
    assert_eq!(
        (r["request_rate"].as_f64(), r["burstiness"].as_f64(), r["total_output_tokens"].as_u64()),
        (Some(200.0), Some(2.0), Some(24))
    );
    assert_eq!(r["request_goodput"].as_f64(), r["request_throughput"].as_f64());
    assert_eq!(r["input_lens"], serde_json::json!([8, 8, 8, 8, 8, 8]));
    assert!(r["itls"].as_array().unwrap().iter().all(|l| l.as_array().unwrap().len() == 3));
    assert!(r["generated_texts"][0].as_str().unwrap().starts_with("t0 t1"));
    for k in [
        "p50_ttft_ms",
        "p99_tpot_ms",
        "std_itl_ms",
        "median_e2el_ms",
        "max_output_tokens_per_s",
        "date",
        "tokenizer_id",
    ] {
        assert!(r.get(k).is_some(), "{k} missing");
    }
    assert!(r["max_concurrent_requests"].as_u64().unwrap() <= 2);

    let seen = m.seen();
    assert_eq!(seen[0].path, "/v1/models");
    // The vocabulary probe, then the test request, then the six timed ones.
    let posts: Vec<_> = seen.iter().filter(|s| s.method == "POST").collect();
    assert_eq!(posts.len(), 8);
    assert_eq!(posts[0].body["prompt"], serde_json::json!([i32::MAX]));
    assert!(posts.iter().all(|s| s.header("authorization") == Some("Bearer sk-test")));
    for p in &posts[1..] {
        assert_eq!(
            (p.body["ignore_eos"].as_bool(), p.body["stream"].as_bool(), p.body["model"].as_str()),
            (Some(true), Some(true), Some("mock-model"))
        );
        assert!(p.body["prompt"].as_array().unwrap().iter().all(|t| t.as_u64().unwrap() < mock::VOCAB));
        assert!(p.body.get("temperature").is_none(), "sampling parameters only when given");
    }
    assert!(posts[2..].iter().all(|p| p.header("x-request-id").is_some_and(|id| id.starts_with("bench-"))));
    // Kept-alive connections: far fewer than the eight requests.
    assert!(*m.connections.lock().unwrap() <= 4, "{} connections", m.connections.lock().unwrap());
}

#[test]
fn a_failing_server_stops_the_run_at_the_test_request() {
    let m = Mock::start(Behaviour { fail_from: Some(0), ..Default::default() });
    let o = bench(&["--base-url", &m.url(), "--num-prompts", "50", "--random-input-len", "4"], &[]);
    assert!(!o.status.success());
    assert!(text(&o).contains("initial test run failed"), "{}", text(&o));
    assert!(text(&o).contains("scripted failure"));
    assert_eq!(generations(&m).len(), 1, "nothing after the failed test request");
}

#[test]
fn a_run_where_every_request_fails_exits_non_zero_after_reporting() {
    let m = Mock::start(Behaviour { fail_from: Some(1), ..Default::default() });
    let dir = tmp("allfail");
    let out = dir.join("out.json");
    let o = bench(
        &["--base-url", &m.url(), "--num-prompts", "3", "--random-input-len", "4", "--out", out.to_str().unwrap()],
        &[],
    );
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("every request failed") && t.contains("Failed requests:                         3"), "{t}");
    assert!(t.contains("Error 0: HTTP 500"), "{t}");
    assert_eq!(read_json(&out)["results"]["metrics"]["failed"].as_u64(), Some(3));
}

#[test]
fn https_verifies_the_server_unless_told_not_to() {
    let (cfg, ca_pem) = mock::tls_pair();
    let m = Mock::start(Behaviour { tls: Some(cfg), ..Default::default() });
    let url = format!("https://127.0.0.1:{}", m.port);
    let args = ["--base-url", &url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2"];
    let o = bench(&args, &[]);
    assert!(!o.status.success(), "an unknown CA must be refused");
    assert!(text(&o).contains("TLS") || text(&o).contains("certificate"), "{}", text(&o));
    let o = bench(&[&args[..], &["--insecure"]].concat(), &[]);
    assert!(o.status.success(), "{}", text(&o));
    let dir = tmp("ca");
    std::fs::write(dir.join("ca.pem"), ca_pem).unwrap();
    let o = bench(&args, &[("SSL_CERT_FILE", dir.join("ca.pem").to_str().unwrap())]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn the_chat_backend_sends_text_messages_made_from_the_tokenizer() {
    let m = Mock::start(Behaviour::default());
    let demo = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/demo");
    let o = bench(
        &[
            "--backend",
            "openai-chat",
            "--base-url",
            &m.url(),
            "--tokenizer",
            demo,
            "--num-prompts",
            "3",
            "--random-input-len",
            "16",
            "--random-output-len",
            "3",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let chats: Vec<_> = m.seen().into_iter().filter(|s| s.path == "/v1/chat/completions").collect();
    assert_eq!(chats.len(), 4);
    for c in chats {
        let content = &c.body["messages"][0]["content"][0];
        assert_eq!(content["type"].as_str(), Some("text"));
        assert!(!content["text"].as_str().unwrap().is_empty());
        assert_eq!(c.body["max_completion_tokens"].as_u64(), Some(3));
    }
    // Without a tokenizer there is no text to send.
    let o = bench(&["--backend", "openai-chat", "--base-url", &m.url(), "--num-prompts", "1"], &[]);
    assert!(!o.status.success() && text(&o).contains("--tokenizer"), "{}", text(&o));
}

#[test]
fn earlier_mla_bench_command_lines_still_run() {
    // As scripts/gpu_run.sh writes them: --dataset, --prefix-len, --input-len as the suffix, --out.
    let m = Mock::start(Behaviour::default());
    let dir = tmp("old");
    let out = dir.join("serve.json");
    let o = bench(
        &[
            "--base-url",
            &m.url(),
            "--dataset",
            "prefix-repetition",
            "--num-prompts",
            "4",
            "--prefix-len",
            "6",
            "--input-len",
            "2",
            "--output-len",
            "3",
            "--num-prefixes",
            "1",
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--gpu",
            "test GPU",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let v = read_json(&out);
    assert_eq!(v["gpu"].as_str(), Some("test GPU"));
    let r = &v["results"];
    assert_eq!(
        (r["dataset"].as_str(), r["max_concurrency"].as_u64(), r["input_len"].as_u64()),
        (Some("prefix_repetition"), Some(2), Some(2))
    );
    assert!(r["metrics"]["itl"]["median_ms"].as_f64().unwrap() > 0.0, "scripts/plot_performance.py reads this");
    assert!(r["metrics"]["output_throughput"].as_f64().is_some());
    let prompts: Vec<Vec<u64>> = generations(&m)
        .iter()
        .map(|s| s.body["prompt"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect())
        .collect();
    assert_eq!(prompts.len(), 5);
    assert!(prompts.iter().all(|p| p.len() == 8 && p[..6] == prompts[0][..6]));
    // And the multi-turn dataset with its own flags.
    let o = bench(
        &[
            "--base-url",
            &m.url(),
            "--dataset",
            "multi-turn",
            "--num-prompts",
            "2",
            "--num-turns",
            "2",
            "--input-len",
            "3",
            "--output-len",
            "2",
            "--token-id-range",
            "10..20",
        ],
        &[],
    );
    assert!(o.status.success() && text(&o).contains("Median TTFT, turn 2 (ms):"), "{}", text(&o));
}
