//! Process hardening at start: no core dumps. A core of this process would
//! hold root keys, derived subkeys and decrypted state.

/// Sets `RLIMIT_CORE` to 0 (soft and hard) and, on Linux, marks the process
/// non-dumpable (`PR_SET_DUMPABLE` 0), which also keeps other processes of
/// the same user from attaching with ptrace or reading its memory through
/// `/proc`.
#[cfg(unix)]
pub fn disable_core_dumps() -> std::io::Result<()> {
    use rustix::process::{setrlimit, Resource, Rlimit};
    setrlimit(
        Resource::Core,
        Rlimit {
            current: Some(0),
            maximum: Some(0),
        },
    )?;
    #[cfg(target_os = "linux")]
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_os = "linux")]
    fn the_process_becomes_non_dumpable_with_no_core_limit() {
        super::disable_core_dumps().unwrap();
        assert_eq!(
            rustix::process::dumpable_behavior().unwrap(),
            rustix::process::DumpableBehavior::NotDumpable
        );
        let l = rustix::process::getrlimit(rustix::process::Resource::Core);
        assert_eq!((l.current, l.maximum), (Some(0), Some(0)));
    }
}
