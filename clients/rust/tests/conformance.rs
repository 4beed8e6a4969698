//! The official MCP conformance suite's 14 MRTR server scenarios
//! (`input-required-result-*`, spec 2026-07-28) against
//! examples/conformance_server.rs, with stateseal in front as the README
//! shows.
//!
//! The suite (`@modelcontextprotocol/conformance`, pinned in
//! clients/typescript/package-lock.json) comes from `npm ci` in
//! clients/typescript; it needs `fs.globSync`, which Node 20 lacks, so it
//! runs under clients/typescript/scripts/node20/globsync.mjs. The example
//! binary is built by `cargo test` beside this test.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Stateseal;

const SCENARIOS: [&str; 14] = [
    "basic-elicitation",
    "basic-sampling",
    "basic-list-roots",
    "request-state",
    "multiple-input-requests",
    "multi-round",
    "missing-input-response",
    "non-tool-request",
    "result-type",
    "unsupported-methods",
    "tampered-state",
    "capability-check",
    "ignore-extra-params",
    "validate-input",
];

/// The one warning this boundary earns on purpose, as in the other two
/// packages: the scenario sends, in a single first call, `inputResponses`
/// to a question never asked and no `requestState`, and hopes for a
/// complete result. The boundary never hands answers without a sealed
/// token to a handler, so the handler asks instead: the suite's
/// SHOULD-level check warns, and nothing fails.
const EXPECTED_WARNINGS: [(&str, &str); 1] = [(
    "input-required-result-ignore-extra-params",
    "sep-2322-ignore-unexpected-params",
)];

fn ts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../typescript")
}

fn example() -> PathBuf {
    // target/debug/deps/conformance-… → target/debug/examples/
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    dir.join("examples").join("conformance_server")
}

fn suite(args: &[&str], cwd: &Path) -> String {
    let ts = ts();
    let out = Command::new("node")
        .arg("--import")
        .arg(ts.join("scripts/node20/globsync.mjs"))
        .arg(ts.join("node_modules/@modelcontextprotocol/conformance/dist/index.js"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run node");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Parses `Passed: P/T, F failed, W warnings` and the warned check ids.
fn verdict(out: &str) -> Option<(u32, u32, u32, u32, Vec<String>)> {
    let at = out.find("Passed: ")?;
    let rest = &out[at + 8..];
    let nums: Vec<u32> = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .take(4)
        .map(|s| s.parse().ok())
        .collect::<Option<_>>()?;
    let warned = out
        .lines()
        .filter(|l| l.contains("WARNING"))
        .filter_map(|l| {
            // `[check-id   ]`, not an ANSI colour's `ESC[90m`.
            let open = l
                .match_indices('[')
                .map(|(i, _)| i)
                .find(|&i| l[i + 1..].starts_with(|c: char| c.is_ascii_lowercase()))?;
            let close = l[open..].find(']')? + open;
            Some(l[open + 1..close].trim().to_owned())
        })
        .collect();
    Some((nums[0], nums[1], nums[2], nums[3], warned))
}

#[test]
fn the_suites_mrtr_scenarios_pass() {
    let suite_js = ts().join("node_modules/@modelcontextprotocol/conformance/dist/index.js");
    assert!(
        suite_js.exists(),
        "the conformance suite is missing: run `npm ci` in {}",
        ts().display()
    );
    assert!(
        example().exists(),
        "the example is not built: {}",
        example().display()
    );
    let tmp = tempfile::tempdir().expect("tempdir");

    let listed = suite(&["list"], tmp.path());
    let mut found: Vec<&str> = SCENARIOS
        .iter()
        .copied()
        .filter(|s| listed.contains(&format!("input-required-result-{s}")))
        .collect();
    found.sort_unstable();
    let all: usize = listed.matches("input-required-result-").count();
    assert_eq!(
        found.len(),
        SCENARIOS.len(),
        "the suite lists other MRTR scenarios: {listed}"
    );
    assert_eq!(
        all,
        SCENARIOS.len(),
        "the suite lists more MRTR scenarios than these: {listed}"
    );

    let ss = Stateseal::start(&[]);
    let port = common::free_port();
    let _server = Server(
        Command::new(example())
            .args([port.to_string(), ss.addr.clone()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the example"),
    );
    let end = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < end, "the example server did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let url = format!("http://127.0.0.1:{port}/mcp");
    let mut failures = Vec::new();
    for s in SCENARIOS {
        let scenario = format!("input-required-result-{s}");
        let out = suite(
            &["server", "--url", &url, "--scenario", &scenario],
            tmp.path(),
        );
        let expected: Vec<String> = EXPECTED_WARNINGS
            .iter()
            .filter(|(sc, _)| *sc == scenario)
            .map(|(_, w)| (*w).to_owned())
            .collect();
        match verdict(&out) {
            // A scenario that ran no check proves nothing: "Passed: 0/0" fails.
            Some((passed, total, 0, warnings, warned))
                if total > 0
                    && passed == total
                    && warnings as usize == expected.len()
                    && warned == expected =>
            {
                println!("{scenario}: passed {passed}/{total}, {warnings} expected warnings");
            }
            _ => failures.push(format!("{scenario}:\n{out}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
