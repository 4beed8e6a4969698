//! The `stateseal` binary: command line → configuration → tracing → server.

use anyhow::Context;
use clap::Parser;
use stateseal::KeysetFile;
use stateseal::{AuditCommand, Cli, Command, KeysCommand, LogFormat};
use stateseal::{Clock, SystemClock};

/// mimalloc, not the C library's allocator (glibc's, or musl's in the
/// image). An answer is often finished on another worker thread than the one
/// its request arrived on (an audited answer is woken by the round that wrote
/// its line), so its memory is freed on a thread that did not allocate it:
/// glibc's allocator then misses its thread cache on both threads and takes
/// arena locks; mimalloc hands the block back to its own page without a
/// lock. In its `secure` mode (guard pages, encoded free lists, double frees
/// caught), and not asking for transparent huge pages (`no_thp`: each would
/// hold a whole 2 MiB). docs/performance.md, "Build flags".
#[global_allocator]
static ALLOCATOR: stateseal::Allocator = stateseal::Allocator;

/// Errors end the process with exit code 1 and one line: the error and its
/// causes, never a backtrace (whatever RUST_BACKTRACE says).
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn run() -> anyhow::Result<()> {
    stateseal::withhold_panic_details();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            init_tracing(args.log_format);
            if args.allow_core_dumps {
                tracing::warn!("--allow-core-dumps: a crash may write keys and state to disk");
            } else {
                stateseal::disable_core_dumps()
                    .context("cannot disable core dumps (pass --allow-core-dumps to run anyway)")?;
            }
            let runtime = stateseal::runtime().context("cannot start the async runtime")?;
            let served = runtime.block_on(async move {
                // Installed before the server says it is listening, so that a
                // SIGTERM right after start is a graceful stop, not a kill.
                let shutdown = shutdown_signal()?;
                let prepared = args.prepare().await?;
                let listener = tokio::net::TcpListener::bind(args.listen)
                    .await
                    .with_context(|| format!("cannot listen on {}", args.listen))?;
                stateseal::run(listener, prepared.sealer, prepared.options, shutdown).await?;
                Ok(())
            });
            // Bounded: a worker held in a system call that hangs (an audit
            // write to a frozen file system) must not hold the exit.
            runtime.shutdown_timeout(std::time::Duration::from_secs(5));
            served
        }
        Command::Keys(cmd) => keys(cmd),
        Command::Audit(AuditCommand::Verify {
            keyset,
            keyset_kek,
            after,
            files,
        }) => audit_verify(&keyset, keyset_kek.as_ref(), after.as_deref(), &files),
    }
}

/// `audit verify`: a summary line, then each problem; exit 1 if any.
fn audit_verify(
    keyset: &std::path::Path,
    kek: Option<&stateseal::KekUri>,
    after: Option<&str>,
    files: &[std::path::PathBuf],
) -> anyhow::Result<()> {
    let after = after
        .map(|a| {
            a.split_once(':')
                .and_then(|(s, m)| {
                    Some((s.parse::<u64>().ok()?, stateseal::unhex32(m.as_bytes())?))
                })
                .ok_or_else(|| anyhow::anyhow!("--after must be SEQ:MAC (64 lowercase hex digits)"))
        })
        .transpose()?;
    let kek = kek.map(|u| stateseal::open_kek(&u.0)).transpose()?;
    let ring = stateseal::Keyring::from_file_with(&KeysetFile::read(keyset)?, kek.as_deref())?;
    let r = stateseal::verify_audit_log(files, &ring, after)?;
    // The report is written at once, and a reader that goes away early
    // (`| head`) is not an error: the exit status still tells.
    use std::fmt::Write as _;
    let mut out = String::new();
    let span = match (r.first_seq, r.last_seq) {
        (Some(a), Some(b)) => format!("seq {a}..={b}"),
        _ => "no audit line".to_owned(),
    };
    let _ = writeln!(
        out,
        "audit verify: {} lines in {} file(s), {span}; {}; {}",
        r.lines,
        r.files,
        if r.genesis {
            "the chain starts at its beginning"
        } else {
            "the chain starts mid-way (earlier files not given)"
        },
        if r.stopped {
            "ends with a clean stop"
        } else {
            "ends without a stop line (still running, killed, or its end cut)"
        },
    );
    if let (Some(seq), Some(mac)) = (r.last_seq, r.last_mac) {
        let mac: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        let _ = writeln!(
            out,
            "last line: {seq}:{mac} (to check what follows: --after {seq}:{mac})"
        );
    }
    const SHOWN: usize = 100;
    for at in r.unclean_restarts.iter().take(SHOWN) {
        let _ = writeln!(
            out,
            "{at}: note: a restart after a run that did not end with a stop line (a crash or \
             kill -9, or lines cut from that run's end)"
        );
    }
    for at in r.skipped_at_restart.iter().take(SHOWN) {
        let _ = writeln!(out, "{at}");
    }
    for p in r.problems.iter().take(SHOWN) {
        let _ = writeln!(out, "{p}");
    }
    if r.problems.len() > SHOWN {
        let _ = writeln!(out, "... and {} more", r.problems.len() - SHOWN);
    }
    if r.problems.is_empty() {
        let _ = writeln!(out, "OK");
    }
    let mut stdout = std::io::stdout().lock();
    match std::io::Write::write_all(&mut stdout, out.as_bytes())
        .and_then(|()| std::io::Write::flush(&mut stdout))
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e.into()),
        _ => {}
    }
    if r.problems.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{} problem(s) in the audit log", r.problems.len())
    }
}

fn keys(cmd: KeysCommand) -> anyhow::Result<()> {
    let now = SystemClock::new().now_unix();
    match cmd {
        KeysCommand::Init { file, kek } => {
            let mut ks = KeysetFile::generate(now);
            if let Some(uri) = kek {
                ks.rewrap(None, stateseal::open_kek(&uri.0)?.as_ref())?;
            }
            ks.write(&file, true)?;
            println!(
                "wrote {} with primary key 1{}",
                file.display(),
                if ks.kek.is_some() { ", wrapped" } else { "" }
            );
        }
        KeysCommand::Add { file, kek } => {
            let mut ks = KeysetFile::read(&file)?;
            let kek = kek.map(|u| stateseal::open_kek(&u.0)).transpose()?;
            let id = ks.add_staged(now, kek.as_deref())?;
            ks.write(&file, false)?;
            println!("added staged key {id}");
        }
        KeysCommand::Rewrap { file, kek, to_kek } => {
            let mut ks = KeysetFile::read(&file)?;
            let from = kek.map(|u| stateseal::open_kek(&u.0)).transpose()?;
            let to = stateseal::open_kek(&to_kek.0)?;
            ks.rewrap(from.as_deref(), to.as_ref())?;
            ks.write(&file, false)?;
            println!(
                "rewrapped {} under the new key-encryption key",
                file.display()
            );
        }
        KeysCommand::KekGenerate { kek } => {
            stateseal::generate_kek(&kek.0)?;
            println!("created the key-encryption key");
        }
        KeysCommand::Promote {
            file,
            id,
            rollout,
            force,
        } => {
            let mut ks = KeysetFile::read(&file)?;
            ks.promote(id, now, rollout, force)?;
            ks.write(&file, false)?;
            println!("key {id} is primary");
        }
        KeysCommand::Retire {
            file,
            id,
            policy,
            force,
        } => {
            let mut ks = KeysetFile::read(&file)?;
            ks.retire(id, now, policy.into(), force)?;
            ks.write(&file, false)?;
            println!("key {id} is retired");
        }
        KeysCommand::List { file, json, policy } => {
            let ks = KeysetFile::read(&file)?;
            let listing = ks.listing(now, policy.into());
            if json {
                println!("{}", serde_json::to_string_pretty(&listing)?);
            } else {
                print_listing(&listing);
            }
        }
    }
    Ok(())
}

/// The `keys list` table for people.
fn print_listing(listing: &stateseal::KeyListing) {
    use stateseal::{human_age, KeyState};
    println!("now {}", listing.now);
    println!(
        "{:>4}  {:<8}  {:<20}  {:<20}  {:<20}  {:<24}  retire after",
        "id", "state", "created", "promoted", "demoted", "age"
    );
    let or_dash = |t: &Option<String>| t.as_deref().unwrap_or("-").to_owned();
    for k in &listing.keys {
        let age = match (k.primary_for_seconds, k.demoted_for_seconds, k.state) {
            (Some(p), _, _) => format!("primary for {}", human_age(p)),
            (_, Some(d), _) => format!("demoted {} ago", human_age(d)),
            (_, _, KeyState::Retired) => format!("retired {}", or_dash(&k.retired_at)),
            _ => "staged, never primary".to_owned(),
        };
        let retire = match (&k.retire_after, k.retirable_now, k.state) {
            (_, true, _) => "now".to_owned(),
            (Some(at), _, _) => at.clone(),
            (None, _, KeyState::Primary) => "(promote another key first)".to_owned(),
            _ => "-".to_owned(),
        };
        println!(
            "{:>4}  {:<8}  {:<20}  {:<20}  {:<20}  {:<24}  {}",
            k.id,
            k.state.to_string(),
            k.created_at,
            or_dash(&k.promoted_at),
            or_dash(&k.demoted_at),
            age,
            retire
        );
    }
}

fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("STATESEAL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        // sled's debug and trace output dumps its pages (ledger record keys),
        // and tokio_postgres's logs each statement's parameters (ledger ids
        // and expiries): capped, whatever STATESEAL_LOG says.
        .add_directive("sled=warn".parse().expect("static directive"))
        .add_directive("tokio_postgres=info".parse().expect("static directive"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Completes on SIGTERM or SIGINT; the handlers are registered on return.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install the SIGTERM handler")?;
    #[cfg(unix)]
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot install the SIGINT handler")?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutdown signal received; finishing in-flight requests");
    })
}
