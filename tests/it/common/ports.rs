//! A free port for a test's server (used by this crate's tests, the nemesis
//! and the load bench, and by clients/rust's tests and bench, which include
//! this file).

/// A port nothing listens on now, chosen below the kernel's ephemeral
/// range (`net.ipv4.ip_local_port_range`), where no `listen(0)` and no
/// outgoing connection of another test is given a port: so no port the
/// kernel hands out takes it before it is used, and no connection to it can
/// connect to itself. Where that range starts too low to leave room, any
/// free port.
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(0);
    if low > 11_024 {
        for _ in 0..100 {
            let port = rand::Rng::gen_range(&mut rand::thread_rng(), low - 10_000..low);
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}
