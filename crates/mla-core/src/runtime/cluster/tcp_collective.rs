//! The CPU reference backend's collective when its ranks are processes on several nodes: every
//! rank connects to a hub (a thread of node 0), sends its contribution to each call, and gets its
//! result back. The hub combines the calls exactly as `ThreadGroup` does (same checks, same
//! rank-ordered sums, so the same bits), and a rank that leaves, stalls past the timeout or makes
//! another call fails every rank with a message instead of a hang. A correctness reference, not a
//! fast path: every tensor goes through node 0.

use super::wire;
use crate::runtime::collective::{collective_via_call, combine, CollectiveError, Contribution, Kind, Tag};
use serde::{Deserialize, Serialize};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize)]
enum Reply {
    Result(Vec<f32>),
    Failed(String),
}

/// Starts the hub for `world` ranks on an ephemeral port of `ip` and returns its address. The
/// hub thread ends when every rank has gone, or on the first failure (which every rank is told).
pub fn start_hub(ip: std::net::IpAddr, world: usize, timeout: Duration) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind((ip, 0))?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new().name("cpu-collective-hub".into()).spawn(move || {
        if let Err(e) = hub(listener, world, timeout) {
            tracing::error!("the CPU collective hub stopped: {e}");
        }
    })?;
    Ok(addr)
}

fn hub(listener: TcpListener, world: usize, timeout: Duration) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    let mut ranks: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    while ranks.iter().any(Option::is_none) {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(timeout))?;
                let r: usize = wire::recv(&mut s)?;
                anyhow::ensure!(
                    r < world && ranks[r].is_none(),
                    "rank {r} joined the CPU collective twice or out of range"
                );
                ranks[r] = Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => anyhow::bail!("waiting for the CPU ranks to join: {e}"),
        }
    }
    let mut ranks: Vec<TcpStream> = ranks.into_iter().map(|s| s.expect("all joined")).collect();
    loop {
        let mut calls = Vec::with_capacity(world);
        for (r, s) in ranks.iter_mut().enumerate() {
            match wire::recv::<Contribution>(s) {
                Ok(c) => calls.push(c),
                // Every rank gone at a call boundary: the group ended.
                Err(_) if r == 0 => return Ok(()),
                Err(e) => {
                    let why = format!("rank {r} left the group or stalled: {e}");
                    broadcast(&mut ranks, &Reply::Failed(why.clone()));
                    anyhow::bail!(why);
                }
            }
        }
        match combine(&calls) {
            Ok(results) => {
                for (s, out) in ranks.iter_mut().zip(results) {
                    wire::send(s, &Reply::Result(out))?;
                }
            }
            Err(why) => {
                broadcast(&mut ranks, &Reply::Failed(why.clone()));
                anyhow::bail!(why);
            }
        }
    }
}

fn broadcast(ranks: &mut [TcpStream], reply: &Reply) {
    for s in ranks {
        let _ = wire::send(s, reply);
    }
}

/// One rank's connection to the hub.
pub struct TcpRank {
    stream: TcpStream,
    rank: usize,
    world: usize,
    calls: u64,
}

impl TcpRank {
    /// Joins the hub at `hub` as `rank` of `world`; a call waits at most `timeout` for the rest.
    pub fn connect(hub: SocketAddr, rank: usize, world: usize, timeout: Duration) -> anyhow::Result<Self> {
        let mut stream = TcpStream::connect_timeout(&hub, Duration::from_secs(30))
            .map_err(|e| anyhow::anyhow!("rank {rank}: cannot reach the CPU collective hub at {hub}: {e}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        wire::send(&mut stream, &rank)?;
        Ok(TcpRank { stream, rank, world, calls: 0 })
    }

    fn call(&mut self, tag: Tag, kind: Kind, data: &[f32], counts: &[usize]) -> Result<Vec<f32>, CollectiveError> {
        self.calls += 1;
        let c = Contribution::new(tag, self.calls, kind, data, counts);
        let fail = |e: std::io::Error| CollectiveError(format!("rank {}: the collective hub is gone: {e}", self.rank));
        wire::send(&mut self.stream, &c).map_err(fail)?;
        match wire::recv::<Reply>(&mut self.stream).map_err(fail)? {
            Reply::Result(v) => Ok(v),
            Reply::Failed(why) => Err(CollectiveError(why)),
        }
    }
}

collective_via_call!(TcpRank, |r| r.world);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::collective::{Collective, ThreadGroup};

    fn ranks(world: usize, timeout: Duration) -> Vec<TcpRank> {
        let hub = start_hub("127.0.0.1".parse().unwrap(), world, timeout).unwrap();
        (0..world).map(|r| TcpRank::connect(hub, r, world, timeout).unwrap()).collect()
    }

    /// The same calls on TCP ranks and thread ranks give the same bits.
    #[test]
    fn tcp_ranks_compute_what_thread_ranks_compute() {
        let run = |mut c: Box<dyn Collective + Send>| {
            std::thread::spawn(move || {
                let r = c.rank() as f32;
                let mut x = vec![0.1 * r, 1.0 / (r + 3.0), -r];
                c.all_reduce_sum(Tag::new("sum", 0), &mut x).unwrap();
                let counts = [1, 2, 3];
                let local: Vec<f32> = (0..counts[c.rank()]).map(|i| r + 0.25 * i as f32).collect();
                let g = c.all_gather(Tag::new("gather", 1), &local, &counts).unwrap();
                let s = c.reduce_scatter(Tag::new("scatter", 1), &g, &counts).unwrap();
                (x, g, s)
            })
        };
        let tcp: Vec<_> = ranks(3, Duration::from_secs(20)).into_iter().map(|c| run(Box::new(c))).collect();
        let threads: Vec<_> =
            ThreadGroup::ranks(3, Duration::from_secs(20)).into_iter().map(|c| run(Box::new(c))).collect();
        for (a, b) in tcp.into_iter().zip(threads) {
            assert_eq!(a.join().unwrap(), b.join().unwrap());
        }
    }

    #[test]
    fn a_rank_that_leaves_or_calls_something_else_fails_the_others() {
        let mut rs = ranks(2, Duration::from_secs(20));
        let gone = rs.pop().unwrap();
        drop(gone);
        let e = rs[0].all_reduce_sum(Tag::new("sum", 0), &mut [1.0]).unwrap_err().to_string();
        assert!(e.contains("rank 1 left"), "{e}");

        let rs = ranks(2, Duration::from_secs(20));
        let handles: Vec<_> = rs
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let op = if c.rank() == 0 { "attention" } else { "ffn" };
                    c.all_reduce_sum(Tag::new(op, 3), &mut [1.0]).unwrap_err().to_string()
                })
            })
            .collect();
        for h in handles {
            let e = h.join().unwrap();
            assert!(e.contains("different calls") && e.contains("ffn of layer 3"), "{e}");
        }
    }
}
