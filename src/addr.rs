//! Server addresses: `HOST:PORT` for TCP, `unix:PATH` for a Unix socket,
//! `tls://HOST:PORT` for TCP with TLS, `etcd://HOST:PORT[,HOST:PORT…]` for
//! the members of an etcd cluster (`etcds://` with TLS), with
//! `?layout=etcd` to share locks with etcd's own recipe.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// The default address a server listens on and a client connects to:
/// loopback only, so that exposing the server is an explicit choice.
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:5862";

/// Where a server listens or a client connects.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Address {
    /// `HOST:PORT`; the host may be a name, resolved when used.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
    /// `tls://HOST:PORT`: TCP with TLS; a client checks the certificate
    /// against HOST.
    Tls(String),
    /// `etcd://HOST:PORT[,HOST:PORT…][?layout=etcd]`: members of one etcd
    /// v3 cluster, reached through its HTTP/JSON gateway (a client address
    /// only); `etcds://` reaches them over TLS.
    Etcd {
        endpoints: Vec<String>,
        tls: bool,
        layout: EtcdLayout,
    },
}

/// Where the locks live in etcd's keys (`?layout=`, docs/ETCD.md, "Two
/// layouts").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EtcdLayout {
    /// kunci's own, `kunci/LEN:KEY/LEASEID` (`?layout=kunci`, the
    /// default): permits, listing, names that never collide.
    #[default]
    Kunci,
    /// etcd's `client/v3/concurrency` recipe, `KEY/LEASEID`
    /// (`?layout=etcd`): exclusive locks and elections shared with
    /// `etcdctl lock`, `etcdctl elect` and Go's `Mutex` and `Election`.
    Etcd,
}

impl EtcdLayout {
    /// The one layout of a client's `etcd://` addresses (the default when
    /// there is none); `Err` with the reason when they name different
    /// ones: one cluster has one layout. Not inlined: a cold check with
    /// three callers is smaller as one copy.
    #[inline(never)]
    pub fn of(servers: &[Address]) -> Result<EtcdLayout, &'static str> {
        let mut layouts = servers.iter().filter_map(|address| match address {
            Address::Etcd { layout, .. } => Some(*layout),
            _ => None,
        });
        let first = layouts.next().unwrap_or_default();
        if layouts.any(|layout| layout != first) {
            return Err("the members of one etcd cluster have one layout: \
                        give ?layout=etcd on every etcd:// address or on none");
        }
        Ok(first)
    }

    /// The layout an address's query names: `layout=kunci` or
    /// `layout=etcd`; any other parameter is refused.
    fn parse(query: &str) -> Result<EtcdLayout, String> {
        let mut layout = EtcdLayout::Kunci;
        for item in query.split('&') {
            layout = match item {
                "layout=kunci" => EtcdLayout::Kunci,
                "layout=etcd" => EtcdLayout::Etcd,
                _ => {
                    return Err(format!(
                        "unknown option {item:?} (etcd addresses take ?layout=kunci or \
                         ?layout=etcd)"
                    ));
                }
            };
        }
        Ok(layout)
    }
}

/// An address (or an `--allow` network) that does not parse, with the
/// part that is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressError {
    /// "address" or "network".
    kind: &'static str,
    input: String,
    problem: String,
}

impl AddressError {
    fn address(input: &str, problem: impl Into<String>) -> AddressError {
        AddressError {
            kind: "address",
            input: input.to_owned(),
            problem: problem.into(),
        }
    }

    fn network(input: &str, problem: impl Into<String>) -> AddressError {
        AddressError {
            kind: "network",
            input: input.to_owned(),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for AddressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid {} {:?}: {}",
            self.kind, self.input, self.problem
        )
    }
}

impl std::error::Error for AddressError {}

impl FromStr for Address {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<Address, AddressError> {
        let etcd = match text.strip_prefix("etcds://") {
            Some(members) => Some((members, true)),
            None => text.strip_prefix("etcd://").map(|members| (members, false)),
        };
        if let Some((members, tls)) = etcd {
            let (members, layout) = match members.split_once('?') {
                Some((members, query)) => (
                    members,
                    EtcdLayout::parse(query)
                        .map_err(|problem| AddressError::address(text, problem))?,
                ),
                None => (members, EtcdLayout::Kunci),
            };
            let endpoints: Vec<String> = members.split(',').map(|m| m.trim().to_owned()).collect();
            for endpoint in &endpoints {
                host_port_problem(endpoint).map_or(Ok(()), |problem| {
                    Err(AddressError::address(
                        text,
                        format!("etcd member {endpoint:?}: {problem}"),
                    ))
                })?;
            }
            return Ok(Address::Etcd {
                endpoints,
                tls,
                layout,
            });
        }
        if let Some(host_port) = text.strip_prefix("tls://") {
            if let Some(problem) = host_port_problem(host_port) {
                return Err(AddressError::address(
                    text,
                    format!("{problem} (expected tls://HOST:PORT)"),
                ));
            }
            return Ok(Address::Tls(host_port.to_owned()));
        }
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(AddressError::address(text, "no path after unix:"));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        if let Some((scheme, _)) = text.split_once("://") {
            return Err(AddressError::address(
                text,
                format!("unknown scheme {scheme}:// (expected {CLIENT_FORMS}"),
            ));
        }
        if let Some(problem) = host_port_problem(text) {
            return Err(AddressError::address(
                text,
                format!("{problem} (expected {CLIENT_FORMS}"),
            ));
        }
        Ok(Address::Tcp(text.to_owned()))
    }
}

impl Address {
    /// Whether a secret sent to this address stays between this host and
    /// the server, or is protected on the way (spec §12.5): `tls://`, a
    /// unix socket, or TCP to a loopback address (127.0.0.0/8, ::1) or to
    /// the name `localhost` itself. Any other name counts as remote, even
    /// one that resolves to loopback: the client cannot know what a name
    /// resolves to everywhere it runs. `etcd://` carries no kunci secret.
    pub fn keeps_secrets_private(&self) -> bool {
        match self {
            Address::Unix(_) | Address::Tls(_) | Address::Etcd { .. } => true,
            Address::Tcp(host_port) => {
                let host = host_port
                    .rsplit_once(':')
                    .map_or(host_port.as_str(), |(host, _)| host);
                let host = host
                    .strip_prefix('[')
                    .and_then(|host| host.strip_suffix(']'))
                    .unwrap_or(host);
                host == "localhost"
                    || host.parse::<std::net::IpAddr>().is_ok_and(|ip| match ip {
                        std::net::IpAddr::V6(v6) => {
                            v6.is_loopback()
                                || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
                        }
                        v4 => v4.is_loopback(),
                    })
            }
        }
    }
}

/// The end of a client address's parse error, naming what a client takes.
const CLIENT_FORMS: &str = "HOST:PORT, unix:PATH, tls://HOST:PORT or etcd://HOST:PORT[,...])";
/// What a server listens on: no etcd://.
const LISTEN_FORMS: &str = "HOST:PORT, tls://HOST:PORT or unix:PATH)";

/// Parses an address a server listens on (`--listen`): as a client
/// address, but `etcd://` is refused and a message names only the forms a
/// server takes.
pub fn parse_listen(text: &str) -> Result<Address, AddressError> {
    match text.parse() {
        Ok(Address::Etcd { .. }) => Err(AddressError::address(
            text,
            "etcd:// is a client address: a kunci server listens on HOST:PORT, \
             tls://HOST:PORT or unix:PATH",
        )),
        Ok(address) => Ok(address),
        Err(mut error) => {
            error.problem = error.problem.replace(CLIENT_FORMS, LISTEN_FORMS);
            Err(error)
        }
    }
}

/// What is wrong with `HOST:PORT`, if anything.
fn host_port_problem(text: &str) -> Option<String> {
    let Some((host, port)) = text.rsplit_once(':') else {
        return Some("no port".to_owned());
    };
    if host.is_empty() {
        return Some("no host before the port".to_owned());
    }
    if port.parse::<u16>().is_err() {
        return Some(format!("port {port:?} is not a number 0..=65535"));
    }
    None
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Tcp(host_port) => f.write_str(host_port),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
            Address::Tls(host_port) => write!(f, "tls://{host_port}"),
            Address::Etcd {
                endpoints,
                tls,
                layout,
            } => {
                let scheme = if *tls { "etcds" } else { "etcd" };
                let query = match layout {
                    EtcdLayout::Kunci => "",
                    EtcdLayout::Etcd => "?layout=etcd",
                };
                write!(f, "{scheme}://{}{query}", endpoints.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listen_address_names_only_what_a_server_takes() {
        let error = parse_listen("127.0.0.1").unwrap_err().to_string();
        assert_eq!(
            error,
            "invalid address \"127.0.0.1\": no port \
             (expected HOST:PORT, tls://HOST:PORT or unix:PATH)"
        );
        assert!(parse_listen("etcd://a:1").is_err());
        assert_eq!(parse_listen("unix:/k"), Ok(Address::Unix("/k".into())));
    }

    #[test]
    fn secrets_stay_private_over_tls_unix_and_loopback_only() {
        for private in [
            "127.0.0.1:5862",
            "127.9.9.9:1",
            "[::1]:5862",
            "[::ffff:127.0.0.1]:1",
            "localhost:5862",
            "unix:/run/kunci.sock",
            "tls://db1:5862",
            "tls://10.0.0.1:5862",
        ] {
            let address: Address = private.parse().unwrap();
            assert!(address.keeps_secrets_private(), "{private}");
        }
        for public in [
            "0.0.0.0:5862",
            "10.0.0.1:5862",
            "[fd00::1]:5862",
            "db1:5862",
            "localhost.localdomain:5862",
            "LOCALHOST:5862",
            "ip6-localhost:5862",
        ] {
            let address: Address = public.parse().unwrap();
            assert!(!address.keeps_secrets_private(), "{public}");
        }
    }

    #[test]
    fn parses_tcp_and_unix() {
        assert_eq!(
            "127.0.0.1:5862".parse(),
            Ok(Address::Tcp("127.0.0.1:5862".into()))
        );
        assert_eq!("[::1]:0".parse(), Ok(Address::Tcp("[::1]:0".into())));
        assert_eq!(
            "unix:/tmp/k.sock".parse(),
            Ok(Address::Unix("/tmp/k.sock".into()))
        );
        assert_eq!(
            "tls://db1:5862".parse(),
            Ok(Address::Tls("db1:5862".into()))
        );
        assert_eq!(
            "tls://db1:5862".parse::<Address>().unwrap().to_string(),
            "tls://db1:5862"
        );
        assert_eq!(
            "etcd://127.0.0.1:2379,db2:2379".parse(),
            Ok(Address::Etcd {
                endpoints: vec!["127.0.0.1:2379".into(), "db2:2379".into()],
                tls: false,
                layout: EtcdLayout::Kunci,
            })
        );
        assert_eq!(
            "etcds://db1:2379".parse::<Address>().unwrap().to_string(),
            "etcds://db1:2379"
        );
        assert_eq!(
            "etcd://a:1,b:2".parse::<Address>().unwrap().to_string(),
            "etcd://a:1,b:2"
        );
        for bad in [
            "",
            "unix:",
            "localhost",
            ":5862",
            "host:port",
            "host:70000",
            "etcd://",
            "etcd://a:1,",
            "etcd://a",
            "tls://",
            "tls://host",
            "http://host:80",
            "redis://host:6379",
        ] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
        // The message names the part that is wrong.
        let error = |text: &str| text.parse::<Address>().unwrap_err().to_string();
        assert_eq!(
            error("nohost"),
            "invalid address \"nohost\": no port \
             (expected HOST:PORT, unix:PATH, tls://HOST:PORT or etcd://HOST:PORT[,...])"
        );
        assert_eq!(
            error(":5862"),
            "invalid address \":5862\": no host before the port \
             (expected HOST:PORT, unix:PATH, tls://HOST:PORT or etcd://HOST:PORT[,...])"
        );
        assert_eq!(
            error("host:70000"),
            "invalid address \"host:70000\": port \"70000\" is not a number 0..=65535 \
             (expected HOST:PORT, unix:PATH, tls://HOST:PORT or etcd://HOST:PORT[,...])"
        );
        assert_eq!(
            error("http://h:80"),
            "invalid address \"http://h:80\": unknown scheme http:// \
             (expected HOST:PORT, unix:PATH, tls://HOST:PORT or etcd://HOST:PORT[,...])"
        );
        assert_eq!(
            error("unix:"),
            "invalid address \"unix:\": no path after unix:"
        );
        assert_eq!(
            error("etcd://a:1,b"),
            "invalid address \"etcd://a:1,b\": etcd member \"b\": no port"
        );
    }

    #[test]
    fn an_etcd_address_names_its_layout_and_shows_it_back() {
        let etcd = |text: &str| match text.parse::<Address>() {
            Ok(Address::Etcd {
                endpoints, layout, ..
            }) => (endpoints, layout),
            other => panic!("{text}: {other:?}"),
        };
        assert_eq!(
            etcd("etcd://127.0.0.1:2379,[::1]:2380?layout=etcd"),
            (
                vec!["127.0.0.1:2379".to_owned(), "[::1]:2380".to_owned()],
                EtcdLayout::Etcd
            )
        );
        assert_eq!(etcd("etcds://h:1?layout=kunci").1, EtcdLayout::Kunci);
        assert_eq!(etcd("etcd://h:1").1, EtcdLayout::Kunci);
        // The last one given counts, as in the Python client.
        assert_eq!(
            etcd("etcd://h:1?layout=kunci&layout=etcd").1,
            EtcdLayout::Etcd
        );
        for (text, shown) in [
            ("etcd://a:1,b:2?layout=etcd", "etcd://a:1,b:2?layout=etcd"),
            ("etcds://a:1?layout=etcd", "etcds://a:1?layout=etcd"),
            ("etcds://a:1?layout=kunci", "etcds://a:1"),
        ] {
            assert_eq!(text.parse::<Address>().unwrap().to_string(), shown);
        }
        let error = |text: &str| text.parse::<Address>().unwrap_err().to_string();
        assert_eq!(
            error("etcd://h:1?layout=zk"),
            "invalid address \"etcd://h:1?layout=zk\": unknown option \"layout=zk\" \
             (etcd addresses take ?layout=kunci or ?layout=etcd)"
        );
        assert_eq!(
            error("etcd://h:1?mode=etcd"),
            "invalid address \"etcd://h:1?mode=etcd\": unknown option \"mode=etcd\" \
             (etcd addresses take ?layout=kunci or ?layout=etcd)"
        );
        // One cluster, one layout: however the members are given.
        let layout_of = |texts: &[&str]| {
            let servers: Vec<Address> = texts.iter().map(|text| text.parse().unwrap()).collect();
            EtcdLayout::of(&servers)
        };
        assert_eq!(layout_of(&["etcd://a:1?layout=etcd"]), Ok(EtcdLayout::Etcd));
        assert_eq!(
            layout_of(&["etcd://a:1?layout=etcd", "etcd://b:1?layout=etcd"]),
            Ok(EtcdLayout::Etcd)
        );
        assert_eq!(
            layout_of(&["etcd://a:1", "etcd://b:1?layout=kunci"]),
            Ok(EtcdLayout::Kunci)
        );
        assert_eq!(layout_of(&["a:1"]), Ok(EtcdLayout::Kunci));
        assert_eq!(
            layout_of(&["etcd://a:1?layout=etcd", "etcd://b:1"]),
            Err("the members of one etcd cluster have one layout: \
                 give ?layout=etcd on every etcd:// address or on none")
        );
        for bad in [
            "etcd://h:1?layout",
            "etcd://h:1?",
            "etcd://h:1?layout=ETCD",
            "etcd://h:1?layout=etcd&x=1",
            "etcd://h:1?layout=etcd,h:2",
            "etcd://?layout=etcd",
            "tls://h:1?layout=etcd",
            "h:1?layout=etcd",
        ] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }
}

/// A network in CIDR notation (`10.0.0.0/8`, `::1/128`, or a bare address
/// meaning just that host), for the server's `--allow` list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    base: std::net::IpAddr,
    prefix_len: u8,
}

impl Network {
    /// Whether `ip` is inside this network. IPv4-mapped IPv6 peers
    /// (`::ffff:a.b.c.d`) match IPv4 networks.
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.base, ip) {
            (IpAddr::V4(base), IpAddr::V4(ip)) => prefix_matches(
                u32::from(base).into(),
                u32::from(ip).into(),
                self.prefix_len,
                32,
            ),
            (IpAddr::V6(base), IpAddr::V6(ip)) => {
                prefix_matches(u128::from(base), u128::from(ip), self.prefix_len, 128)
            }
            _ => false,
        }
    }
}

fn prefix_matches(base: u128, ip: u128, prefix_len: u8, bits: u32) -> bool {
    if prefix_len == 0 {
        return true;
    }
    let shift = bits - u32::from(prefix_len);
    base >> shift == ip >> shift
}

impl FromStr for Network {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<Network, AddressError> {
        let (ip, prefix) = match text.split_once('/') {
            Some((ip, prefix)) => (ip, Some(prefix)),
            None => (text, None),
        };
        let base: std::net::IpAddr = ip.parse().map_err(|_| {
            AddressError::network(
                text,
                format!("{ip:?} is not an IP address (expected a network such as 10.0.0.0/8)"),
            )
        })?;
        let bits = if base.is_ipv4() { 32 } else { 128 };
        let prefix_len = match prefix {
            Some(prefix) => prefix
                .parse::<u8>()
                .ok()
                .filter(|len| u32::from(*len) <= bits)
                .ok_or_else(|| {
                    AddressError::network(
                        text,
                        format!("prefix length {prefix:?} is not a number 0..={bits}"),
                    )
                })?,
            None => bits as u8,
        };
        Ok(Network { base, prefix_len })
    }
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix_len)
    }
}

#[cfg(test)]
mod network_tests {
    use super::*;

    #[test]
    fn networks_match_their_prefix() {
        let private: Network = "10.0.0.0/8".parse().unwrap();
        assert!(private.contains("10.1.2.3".parse().unwrap()));
        assert!(!private.contains("11.0.0.1".parse().unwrap()));
        assert!(private.contains("::ffff:10.9.9.9".parse().unwrap()));
        let host: Network = "127.0.0.1".parse().unwrap();
        assert!(host.contains("127.0.0.1".parse().unwrap()));
        assert!(!host.contains("127.0.0.2".parse().unwrap()));
        let everyone: Network = "0.0.0.0/0".parse().unwrap();
        assert!(everyone.contains("8.8.8.8".parse().unwrap()));
        let v6: Network = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("10.0.0.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "::/129", "nope", "10.0.0.0/"] {
            assert!(bad.parse::<Network>().is_err(), "{bad}");
        }
        let error = |text: &str| text.parse::<Network>().unwrap_err().to_string();
        assert_eq!(
            error("10.0.0.0/33"),
            "invalid network \"10.0.0.0/33\": prefix length \"33\" is not a number 0..=32"
        );
        assert_eq!(
            error("::/129"),
            "invalid network \"::/129\": prefix length \"129\" is not a number 0..=128"
        );
        assert_eq!(
            error("nope/8"),
            "invalid network \"nope/8\": \"nope\" is not an IP address \
             (expected a network such as 10.0.0.0/8)"
        );
    }
}
