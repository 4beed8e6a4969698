//! A clock offset for the real binary: an `LD_PRELOAD` shim (compiled
//! here with the system C compiler) adds an offset, read from a file the
//! test rewrites, to `clock_gettime(CLOCK_REALTIME)`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use super::process::{spawn, ServerProcess};

/// How often the shim reads the offset file: a process keeps an offset
/// this long after the file changed (longer only while another of its
/// threads is in the middle of reading it).
pub const READ_EVERY_MS: u64 = 50;

const SHIM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static int (*real_clock_gettime)(clockid_t, struct timespec *);
static long long offset_s, next_read_ms;
int clock_gettime(clockid_t id, struct timespec *ts) {
  if (!real_clock_gettime)
    real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
  int r = real_clock_gettime(id, ts);
  if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
    struct timespec m;
    real_clock_gettime(CLOCK_MONOTONIC, &m);
    long long ms = m.tv_sec * 1000LL + m.tv_nsec / 1000000;
    if (ms >= next_read_ms) {
      next_read_ms = ms + READ_EVERY_MS;
      const char *p = getenv("STATESEAL_TEST_CLOCK_OFFSET_FILE");
      FILE *f = p ? fopen(p, "r") : NULL;
      if (f) {
        long long v;
        if (fscanf(f, "%lld", &v) == 1) offset_s = v;
        fclose(f);
      }
    }
    ts->tv_sec += offset_s;
  }
  return r;
}
"#;

/// The shim library, or `None` (with a loud SKIPPED) without a C compiler.
pub fn shim(dir: &Path) -> Option<PathBuf> {
    let src = dir.join("clockshim.c");
    let lib = dir.join("libclockshim.so");
    std::fs::write(&src, SHIM).unwrap();
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2"])
        .arg(format!("-DREAD_EVERY_MS={READ_EVERY_MS}"))
        .arg("-o")
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .output();
    match out {
        Ok(o) if o.status.success() => Some(lib),
        Ok(o) => panic!(
            "cannot build the clock shim: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            super::skip::skipped(
                "clock-shim",
                &format!("the clock-step tests need a C compiler (cc): {e}"),
            );
            None
        }
    }
}

pub struct Skewed {
    lib: PathBuf,
    offset_file: PathBuf,
}

impl Skewed {
    pub fn new(dir: &Path) -> Option<Self> {
        let lib = shim(dir)?;
        let s = Skewed {
            lib,
            offset_file: dir.join("offset"),
        };
        s.set(0);
        Some(s)
    }
    pub fn set(&self, secs: i64) {
        let tmp = self.offset_file.with_extension("tmp");
        std::fs::write(&tmp, secs.to_string()).unwrap();
        std::fs::rename(&tmp, &self.offset_file).unwrap();
    }
    pub fn spawn(&self, data: &Path, args: &[&str], envs: &[(&str, &str)]) -> ServerProcess {
        let mut all = vec![
            ("LD_PRELOAD", self.lib.to_str().unwrap()),
            (
                "STATESEAL_TEST_CLOCK_OFFSET_FILE",
                self.offset_file.to_str().unwrap(),
            ),
        ];
        all.extend_from_slice(envs);
        spawn(data, args, &all)
    }
}
