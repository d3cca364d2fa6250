//! How the nodes of one server find each other. Node 0 listens at `--dist-init-addr`; every other
//! node connects there and says who it is and what it was started with (`Hello`). Node 0 checks
//! that every node agrees (same node count, layout and model, each node rank once) and answers
//! each with the bootstrap bytes (the NCCL unique id, or the CPU collective's address), or with
//! why it refuses. The connections stay open: the per-step plans and answers travel on them.
//!
//! Nothing waits forever: node 0 waits `timeout` for the others to connect, a node waits as
//! long for node 0 to listen and answer, and the errors say which node or address failed.

use super::wire;
use serde::{Deserialize, Serialize};
use std::io::{self, ErrorKind};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Bumped whenever the messages between nodes change.
pub const PROTOCOL: u32 = 1;

/// What a node tells node 0 about itself; every field but `node_rank` must match node 0's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    pub node_rank: usize,
    pub nnodes: usize,
    /// The parallel layout as flags, e.g. "--tp 4 --enable-dp-attention".
    pub layout: String,
    /// What the node serves: model config and weights, e.g. "DeepseekV2 (checkpoint /m)".
    pub model: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    Welcome { bootstrap: Vec<u8> },
    Refused { why: String },
}

/// One open connection to another node.
#[derive(Debug)]
pub struct NodeLink {
    pub node: usize,
    stream: TcpStream,
}

impl NodeLink {
    pub fn send<T: Serialize>(&mut self, msg: &T) -> io::Result<()> {
        wire::send(&mut self.stream, msg)
    }

    pub fn recv<T: serde::de::DeserializeOwned>(&mut self) -> io::Result<T> {
        wire::recv(&mut self.stream)
    }

    /// A second handle on the same connection (a reader thread's).
    pub fn try_clone(&self) -> io::Result<NodeLink> {
        Ok(NodeLink { node: self.node, stream: self.stream.try_clone()? })
    }

    /// Closes both directions, which ends a reader blocked on the other handle.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("--dist-init-addr {addr}: cannot resolve it: {e}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("--dist-init-addr {addr}: resolves to no address"))
}

/// Node 0: listens at `addr`, waits for the other `hello.nnodes - 1` nodes, checks them against
/// `hello` and sends each `bootstrap`. Returns their links in node order.
pub fn lead(addr: &str, hello: &Hello, bootstrap: &[u8], timeout: Duration) -> anyhow::Result<Vec<NodeLink>> {
    let at = resolve(addr)?;
    let listener = TcpListener::bind(at).map_err(|e| {
        anyhow::anyhow!("--dist-init-addr {addr}: node 0 cannot listen there ({e}); it must be an address of node 0")
    })?;
    listener.set_nonblocking(true)?;
    let others = hello.nnodes - 1;
    tracing::info!("node 0 of {}: waiting at {at} for {others} other node(s)", hello.nnodes);
    let deadline = Instant::now() + timeout;
    let mut links: Vec<Option<NodeLink>> = (0..hello.nnodes).map(|_| None).collect();
    let mut joined = 0;
    while joined < others {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<usize> = (1..hello.nnodes).filter(|&n| links[n].is_none()).collect();
                    anyhow::bail!(
                        "node(s) {missing:?} did not join at {at} within {:.0} s; start them with the same --nnodes and --dist-init-addr",
                        timeout.as_secs_f64()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut link = NodeLink { node: usize::MAX, stream };
        let theirs: Hello = match link.recv() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("ignoring a connection from {peer} that is not an mla-serve node: {e}");
                continue;
            }
        };
        if let Err(why) = check(hello, &theirs, &links) {
            let _ = link.send(&Answer::Refused { why: why.clone() });
            anyhow::bail!("node at {peer}: {why}");
        }
        tracing::info!("node {} joined from {peer}", theirs.node_rank);
        link.node = theirs.node_rank;
        links[theirs.node_rank] = Some(link);
        joined += 1;
    }
    let mut out = Vec::with_capacity(others);
    for link in links.into_iter().flatten() {
        let mut link = link;
        link.stream.set_read_timeout(None)?;
        link.send(&Answer::Welcome { bootstrap: bootstrap.to_vec() })?;
        out.push(link);
    }
    Ok(out)
}

/// What makes a joining node unacceptable to node 0, in words both sides print.
fn check(ours: &Hello, theirs: &Hello, links: &[Option<NodeLink>]) -> Result<(), String> {
    let n = theirs.node_rank;
    if theirs.protocol != ours.protocol {
        return Err(format!(
            "node {n} speaks protocol {}, node 0 {}: run the same mla-serve build",
            theirs.protocol, ours.protocol
        ));
    }
    if theirs.nnodes != ours.nnodes {
        return Err(format!(
            "node {n} was started with --nnodes {}, node 0 with --nnodes {}",
            theirs.nnodes, ours.nnodes
        ));
    }
    if n == 0 || n >= ours.nnodes {
        return Err(format!("node rank {n} is not in 1..{}", ours.nnodes));
    }
    if links[n].is_some() {
        return Err(format!("two nodes were started with --node-rank {n}"));
    }
    if theirs.layout != ours.layout {
        return Err(format!("node {n} runs `{}`, node 0 `{}`", theirs.layout, ours.layout));
    }
    if theirs.model != ours.model {
        return Err(format!("node {n} serves {}, node 0 {}", theirs.model, ours.model));
    }
    Ok(())
}

/// Any other node: connects to node 0 at `addr` (retrying while node 0 is not up yet), says
/// hello, and returns the link and node 0's bootstrap bytes.
pub fn follow(addr: &str, hello: &Hello, timeout: Duration) -> anyhow::Result<(NodeLink, Vec<u8>)> {
    let at = resolve(addr)?;
    let deadline = Instant::now() + timeout;
    let mut last_note = Instant::now();
    let stream = loop {
        match TcpStream::connect_timeout(&at, Duration::from_secs(5)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                if last_note.elapsed() > Duration::from_secs(10) {
                    tracing::info!("node {}: node 0 is not reachable at {at} yet ({e}); retrying", hello.node_rank);
                    last_note = Instant::now();
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => anyhow::bail!(
                "--dist-init-addr {addr}: node 0 was not reachable within {:.0} s ({e})",
                timeout.as_secs_f64()
            ),
        }
    };
    stream.set_nodelay(true)?;
    let mut link = NodeLink { node: 0, stream };
    link.send(hello)?;
    link.stream.set_read_timeout(Some(timeout))?;
    let answer: Answer = link.recv().map_err(|e| anyhow::anyhow!("node 0 at {at} did not answer: {e}"))?;
    link.stream.set_read_timeout(None)?;
    match answer {
        Answer::Welcome { bootstrap } => Ok((link, bootstrap)),
        Answer::Refused { why } => anyhow::bail!("node 0 refused this node: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(node_rank: usize) -> Hello {
        Hello { protocol: PROTOCOL, node_rank, nnodes: 3, layout: "--tp 3".into(), model: "m".into() }
    }

    fn free_addr() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    }

    #[test]
    fn three_nodes_meet_and_keep_their_links() {
        let addr = free_addr();
        let a = addr.clone();
        let leader = std::thread::spawn(move || lead(&a, &hello(0), b"boot", Duration::from_secs(20)));
        // Node 2 first: node 0 returns the links in node order anyway.
        let followers: Vec<_> = [2, 1]
            .into_iter()
            .map(|n| {
                let a = addr.clone();
                std::thread::spawn(move || follow(&a, &hello(n), Duration::from_secs(20)).unwrap())
            })
            .collect();
        let mut links = leader.join().unwrap().unwrap();
        assert_eq!(links.iter().map(|l| l.node).collect::<Vec<_>>(), vec![1, 2]);
        let mut ends: Vec<(NodeLink, Vec<u8>)> = followers.into_iter().map(|f| f.join().unwrap()).collect();
        assert!(ends.iter().all(|(_, b)| b == b"boot"));
        // The links carry messages both ways afterwards (followers joined as node 2, then 1).
        let (l1, _) = &mut ends[1];
        links[0].send(&"to node 1".to_string()).unwrap();
        assert_eq!(l1.recv::<String>().unwrap(), "to node 1");
        l1.send(&42u32).unwrap();
        assert_eq!(links[0].recv::<u32>().unwrap(), 42);
    }

    #[test]
    fn a_node_started_differently_is_refused_with_the_reason() {
        let addr = free_addr();
        let a = addr.clone();
        let leader = std::thread::spawn(move || lead(&a, &hello(0), b"", Duration::from_secs(20)));
        let mut bad = hello(1);
        bad.layout = "--tp 3 --enable-dp-attention".into();
        let e = follow(&addr, &bad, Duration::from_secs(20)).unwrap_err().to_string();
        assert!(e.contains("refused") && e.contains("enable-dp-attention"), "{e}");
        let e = leader.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("node 1 runs"), "{e}");
    }

    #[test]
    fn nobody_waits_forever() {
        // No node 0: the follower gives up naming the address.
        let addr = free_addr();
        let e = follow(&addr, &hello(1), Duration::from_millis(700)).unwrap_err().to_string();
        assert!(e.contains("not reachable") && e.contains(&addr), "{e}");
        // No other nodes: node 0 gives up naming the missing ones.
        let e = lead(&addr, &hello(0), b"", Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("[1, 2] did not join"), "{e}");
        // An address that is not node 0's cannot be listened on.
        let e = lead("192.0.2.1:1", &hello(0), b"", Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("cannot listen"), "{e}");
    }
}
