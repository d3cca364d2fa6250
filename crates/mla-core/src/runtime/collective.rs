//! The collectives a rank's forward pass needs from its peers, on host memory (f32): what the CPU
//! reference backend's ranks use to run the sharded plans of tensor parallelism and DP attention.
//! `ThreadGroup` connects ranks that are threads of one process.
//!
//! Every rank must make the same calls in the same order. Each call names what it is for (`Tag`),
//! and a rank that calls something else, or never comes, makes every rank of the group fail with
//! a message that says what each rank was doing, instead of hanging: the failure class behind the
//! DP-attention hangs other servers have shipped (an idle rank skipping a collective, two ranks
//! taking different paths).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a collective call is for: its operation and the layer that makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    pub op: &'static str,
    pub layer: usize,
}

impl Tag {
    pub fn new(op: &'static str, layer: usize) -> Self {
        Tag { op, layer }
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} of layer {}", self.op, self.layer)
    }
}

/// A group that cannot complete a collective: ranks disagree, one never came, or one left.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("collective failed: {0}")]
pub struct CollectiveError(pub String);

/// One rank's handle on its group.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Every rank's `data` summed element-wise, in rank order (so every rank gets the same bits),
    /// written back into `data` on every rank.
    fn all_reduce_sum(&mut self, tag: Tag, data: &mut [f32]) -> Result<(), CollectiveError>;

    /// The concatenation, in rank order, of every rank's `local`; rank r contributes `counts[r]`
    /// values (`counts` is the same on every rank).
    fn all_gather(&mut self, tag: Tag, local: &[f32], counts: &[usize]) -> Result<Vec<f32>, CollectiveError>;

    /// Every rank holds `full`, `sum(counts)` values in rank-ordered segments; each rank gets the
    /// element-wise sum over ranks (in rank order) of its own segment, `counts[rank]` values.
    fn reduce_scatter(&mut self, tag: Tag, full: &[f32], counts: &[usize]) -> Result<Vec<f32>, CollectiveError>;
}

/// The identity group of one rank: what a single-rank model calls, so the sharded forward pass
/// has one code path.
#[derive(Debug, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _tag: Tag, _data: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_gather(&mut self, _tag: Tag, local: &[f32], counts: &[usize]) -> Result<Vec<f32>, CollectiveError> {
        check_counts(1, counts, local.len(), 0)?;
        Ok(local.to_vec())
    }
    fn reduce_scatter(&mut self, _tag: Tag, full: &[f32], counts: &[usize]) -> Result<Vec<f32>, CollectiveError> {
        check_counts(1, counts, full.len(), 0)?;
        Ok(full.to_vec())
    }
}

/// Ranks that are threads of one process, meeting at a shared rendezvous for every call.
pub struct ThreadGroup;

impl ThreadGroup {
    /// The `world` handles of a new group, rank order; hand one to each rank's thread. A rank
    /// that waits longer than `timeout` for the others fails the whole group.
    pub fn ranks(world: usize, timeout: Duration) -> Vec<ThreadRank> {
        assert!(world >= 1, "a group has at least one rank");
        let shared =
            Arc::new(Rendezvous { state: Mutex::new(Round::new(world)), changed: Condvar::new(), world, timeout });
        (0..world).map(|rank| ThreadRank { shared: shared.clone(), rank, calls: 0 }).collect()
    }
}

/// One rank of a `ThreadGroup`. Dropping it (its thread ended, or panicked) fails the calls the
/// other ranks wait in, and every later one.
pub struct ThreadRank {
    shared: Arc<Rendezvous>,
    rank: usize,
    /// Calls this rank has made: the ranks of a round must agree on it too.
    calls: u64,
}

struct Rendezvous {
    state: Mutex<Round>,
    changed: Condvar,
    world: usize,
    timeout: Duration,
}

/// What the group holds during one collective.
struct Round {
    /// Contributions of the ranks that have arrived.
    slots: Vec<Option<Contribution>>,
    /// Results not yet taken (set once every rank has arrived).
    results: Vec<Option<Vec<f32>>>,
    /// Ranks that have taken their result; the round ends when all have.
    taken: usize,
    /// Why the group cannot go on, once it cannot.
    failed: Option<String>,
}

/// One rank's part of a collective call (also what a TCP rank sends its hub).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct Contribution {
    /// The call's `Tag`, as text.
    pub tag: String,
    /// The number of this call on its rank.
    pub call: u64,
    pub kind: Kind,
    pub data: Vec<f32>,
    pub counts: Vec<usize>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Kind {
    AllReduce,
    AllGather,
    ReduceScatter,
}

impl Round {
    fn new(world: usize) -> Self {
        Round { slots: vec![None; world], results: vec![None; world], taken: 0, failed: None }
    }

    fn arrived(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn collecting(&self) -> bool {
        self.results.iter().any(|r| r.is_some()) || self.taken > 0
    }

    /// What each rank is doing, for error messages.
    fn describe(&self) -> String {
        let ranks: Vec<String> = self
            .slots
            .iter()
            .enumerate()
            .map(|(r, s)| match s {
                Some(c) => format!("rank {r} is at call {} ({})", c.call, c.tag),
                None => format!("rank {r} has not joined"),
            })
            .collect();
        ranks.join(", ")
    }
}

impl Rendezvous {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round as it was: go on, the
        // panic is reported through its dropped handle.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, round: &mut Round, why: String) -> CollectiveError {
        if round.failed.is_none() {
            round.failed = Some(why);
        }
        self.changed.notify_all();
        CollectiveError(round.failed.clone().expect("set above"))
    }

    /// Waits on the condition variable until `done`, the group failing, or the deadline.
    fn wait_until<'a>(
        &self,
        mut round: MutexGuard<'a, Round>,
        deadline: Instant,
        done: impl Fn(&Round) -> bool,
        waiting_for: impl Fn(&Round) -> String,
    ) -> Result<MutexGuard<'a, Round>, CollectiveError> {
        loop {
            // A result already computed is delivered even if a rank has left since.
            if done(&round) {
                return Ok(round);
            }
            if let Some(why) = &round.failed {
                return Err(CollectiveError(why.clone()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = format!("no progress for {:.1}s: {}", self.timeout.as_secs_f64(), waiting_for(&round));
                return Err(self.fail(&mut round, why));
            }
            round = self.changed.wait_timeout(round, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl ThreadRank {
    fn run(&mut self, c: Contribution) -> Result<Vec<f32>, CollectiveError> {
        let sh = self.shared.clone();
        let deadline = Instant::now() + sh.timeout;
        let me = self.rank;
        // The previous round must be fully collected before this rank's contribution goes in.
        let round = sh.wait_until(
            sh.lock(),
            deadline,
            |r| !r.collecting(),
            |r| format!("rank {me} waits for the previous collective to be collected ({})", r.describe()),
        )?;
        let mut round = round;
        round.slots[me] = Some(c);
        if round.arrived() == sh.world {
            if let Err(why) = complete(&mut round) {
                return Err(sh.fail(&mut round, why));
            }
            sh.changed.notify_all();
        }
        let mut round = sh.wait_until(
            round,
            deadline,
            |r| r.results[me].is_some(),
            |r| format!("rank {me} waits for the others: {}", r.describe()),
        )?;
        let out = round.results[me].take().expect("checked by the wait");
        round.taken += 1;
        if round.taken == sh.world {
            round.slots.iter_mut().for_each(|s| *s = None);
            round.taken = 0;
            sh.changed.notify_all();
        }
        Ok(out)
    }

    fn call(&mut self, tag: Tag, kind: Kind, data: &[f32], counts: &[usize]) -> Result<Vec<f32>, CollectiveError> {
        self.calls += 1;
        self.run(Contribution::new(tag, self.calls, kind, data, counts))
    }
}

impl Contribution {
    pub(crate) fn new(tag: Tag, call: u64, kind: Kind, data: &[f32], counts: &[usize]) -> Self {
        Contribution { tag: tag.to_string(), call, kind, data: data.to_vec(), counts: counts.to_vec() }
    }
}

/// Computes every rank's result once all contributions are in.
fn complete(round: &mut Round) -> Result<(), String> {
    let all: Vec<Contribution> = round.slots.iter().map(|s| s.clone().expect("every rank arrived")).collect();
    let results = combine(&all)?;
    round.results = results.into_iter().map(Some).collect();
    Ok(())
}

/// Every rank's result of one collective call from all ranks' contributions (in rank order),
/// after checking that the ranks agree on the call; an error says how they differ.
pub(crate) fn combine(all: &[Contribution]) -> Result<Vec<Vec<f32>>, String> {
    let first = &all[0];
    let agree = all.iter().all(|c| c.tag == first.tag && c.call == first.call && c.kind == first.kind);
    if !agree {
        let ranks: Vec<String> =
            all.iter().enumerate().map(|(r, c)| format!("rank {r} is at call {} ({})", c.call, c.tag)).collect();
        return Err(format!("the ranks make different calls: {}", ranks.join(", ")));
    }
    let world = all.len();
    let sum_of = |pick: &dyn Fn(&Contribution) -> &[f32]| -> Result<Vec<f32>, String> {
        let n = pick(first).len();
        if let Some((r, c)) = all.iter().enumerate().find(|(_, c)| pick(c).len() != n) {
            return Err(format!("{}: rank {r} gives {} values, rank 0 gives {n}", first.tag, pick(c).len()));
        }
        let mut acc = vec![0f32; n];
        for c in all {
            for (a, x) in acc.iter_mut().zip(pick(c)) {
                *a += x;
            }
        }
        Ok(acc)
    };
    let results: Vec<Vec<f32>> = match first.kind {
        Kind::AllReduce => {
            let s = sum_of(&|c| &c.data)?;
            vec![s; world]
        }
        Kind::AllGather => {
            for (r, c) in all.iter().enumerate() {
                if c.counts != first.counts {
                    return Err(format!(
                        "{}: rank {r} has counts {:?}, rank 0 {:?}",
                        first.tag, c.counts, first.counts
                    ));
                }
                check_counts(world, &c.counts, c.data.len(), r).map_err(|e| e.0)?;
            }
            let cat: Vec<f32> = all.iter().flat_map(|c| c.data.iter().copied()).collect();
            vec![cat; world]
        }
        Kind::ReduceScatter => {
            for (r, c) in all.iter().enumerate() {
                if c.counts != first.counts || c.counts.len() != world || c.data.len() != c.counts.iter().sum::<usize>()
                {
                    return Err(format!(
                        "{}: rank {r} gives {} values in segments {:?}; rank 0 {:?}",
                        first.tag,
                        c.data.len(),
                        c.counts,
                        first.counts
                    ));
                }
            }
            let s = sum_of(&|c| &c.data)?;
            let mut at = 0;
            first
                .counts
                .iter()
                .map(|&n| {
                    let seg = s[at..at + n].to_vec();
                    at += n;
                    seg
                })
                .collect()
        }
    };
    Ok(results)
}

/// Checks that `counts` has one entry per rank and that `rank` contributes `counts[rank]`.
fn check_counts(world: usize, counts: &[usize], len: usize, rank: usize) -> Result<(), CollectiveError> {
    if counts.len() != world || counts[rank] != len {
        return Err(CollectiveError(format!(
            "rank {rank} contributes {len} values with counts {counts:?} for {world} ranks"
        )));
    }
    Ok(())
}

/// `Collective` for a rank type whose `call(tag, kind, data, counts)` runs one collective of
/// any kind (`ThreadRank` in-process, `TcpRank` through a hub): the three operations differ only
/// in the `Kind` they send and in where the answer goes.
macro_rules! collective_via_call {
    ($rank:ty, |$s:ident| $world:expr) => {
        impl $crate::runtime::collective::Collective for $rank {
            fn rank(&self) -> usize {
                self.rank
            }

            fn world(&self) -> usize {
                let $s = self;
                $world
            }

            fn all_reduce_sum(
                &mut self,
                tag: $crate::runtime::collective::Tag,
                data: &mut [f32],
            ) -> Result<(), $crate::runtime::collective::CollectiveError> {
                let out = self.call(tag, $crate::runtime::collective::Kind::AllReduce, data, &[])?;
                data.copy_from_slice(&out);
                Ok(())
            }

            fn all_gather(
                &mut self,
                tag: $crate::runtime::collective::Tag,
                local: &[f32],
                counts: &[usize],
            ) -> Result<Vec<f32>, $crate::runtime::collective::CollectiveError> {
                self.call(tag, $crate::runtime::collective::Kind::AllGather, local, counts)
            }

            fn reduce_scatter(
                &mut self,
                tag: $crate::runtime::collective::Tag,
                full: &[f32],
                counts: &[usize],
            ) -> Result<Vec<f32>, $crate::runtime::collective::CollectiveError> {
                self.call(tag, $crate::runtime::collective::Kind::ReduceScatter, full, counts)
            }
        }
    };
}
pub(crate) use collective_via_call;

collective_via_call!(ThreadRank, |r| r.shared.world);

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let sh = &self.shared;
        let mut round = sh.lock();
        if sh.world > 1 && round.failed.is_none() {
            let why = if std::thread::panicking() {
                format!("rank {} panicked", self.rank)
            } else {
                format!("rank {} left the group", self.rank)
            };
            let _ = sh.fail(&mut round, why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// Runs `f` on every rank of a new group, one thread each, and returns their results.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        f: impl Fn(&mut ThreadRank) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = ThreadGroup::ranks(world, timeout)
            .into_iter()
            .map(|mut r| {
                let f = f.clone();
                thread::spawn(move || f(&mut r))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    #[test]
    fn collectives_give_the_same_bits_on_every_rank() {
        let out = on_ranks(3, Duration::from_secs(10), |g| {
            let r = g.rank() as f32;
            let mut x = vec![r + 0.1, 2.0 * r];
            g.all_reduce_sum(Tag::new("all_reduce", 0), &mut x).unwrap();
            // Rank r contributes r + 1 values.
            let counts = [1, 2, 3];
            let local: Vec<f32> = (0..=g.rank()).map(|i| (10 * g.rank() + i) as f32).collect();
            let gathered = g.all_gather(Tag::new("all_gather", 0), &local, &counts).unwrap();
            let full: Vec<f32> = (0..6).map(|i| (i as f32) * (r + 1.0)).collect();
            let mine = g.reduce_scatter(Tag::new("reduce_scatter", 0), &full, &counts).unwrap();
            (x, gathered, mine)
        });
        for (r, (x, gathered, mine)) in out.iter().enumerate() {
            assert_eq!(x, &vec![0.1f32 + 1.1 + 2.1, 6.0]);
            assert_eq!(gathered, &vec![0.0, 10.0, 11.0, 20.0, 21.0, 22.0]);
            // sum over ranks of i * (r + 1) = 6 i; rank r's segment.
            let seg: Vec<f32> = match r {
                0 => vec![0.0],
                1 => vec![6.0, 12.0],
                _ => vec![18.0, 24.0, 30.0],
            };
            assert_eq!(mine, &seg, "rank {r}");
        }
        // Many rounds back to back keep their order.
        let sums = on_ranks(4, Duration::from_secs(10), |g| {
            (0..200)
                .map(|i| {
                    let mut x = [(g.rank() * i) as f32];
                    g.all_reduce_sum(Tag::new("all_reduce", i), &mut x).unwrap();
                    x[0]
                })
                .collect::<Vec<_>>()
        });
        assert!(sums.iter().all(|s| s.iter().enumerate().all(|(i, &v)| v == (6 * i) as f32)));
    }

    #[test]
    fn a_rank_on_another_call_fails_every_rank_with_a_description() {
        let out = on_ranks(3, Duration::from_secs(10), |g| {
            let tag = if g.rank() == 2 { Tag::new("reduce_scatter", 7) } else { Tag::new("all_gather", 7) };
            let mut x = [1.0];
            g.all_reduce_sum(tag, &mut x).unwrap_err().to_string()
        });
        for e in &out {
            assert!(e.contains("different calls"), "{e}");
            assert!(e.contains("rank 2 is at call 1 (reduce_scatter of layer 7)"), "{e}");
            assert!(e.contains("rank 0 is at call 1 (all_gather of layer 7)"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_skips_a_call_times_out_the_group_instead_of_hanging() {
        let t0 = Instant::now();
        let out = on_ranks(2, Duration::from_millis(300), |g| {
            let mut x = [1.0];
            g.all_reduce_sum(Tag::new("all_reduce", 0), &mut x).unwrap();
            if g.rank() == 1 {
                // An idle rank that forgot the second collective: it waits somewhere else.
                thread::sleep(Duration::from_millis(600));
                return "skipped".to_string();
            }
            g.all_reduce_sum(Tag::new("all_gather", 1), &mut x).unwrap_err().to_string()
        });
        assert!(out[0].contains("rank 1 has not joined") && out[0].contains("all_gather of layer 1"), "{}", out[0]);
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_rank_that_dies_fails_the_others_at_once() {
        let t0 = Instant::now();
        let out = on_ranks(3, Duration::from_secs(30), |g| {
            if g.rank() == 1 {
                return "died".to_string();
            }
            let mut x = [1.0];
            g.all_reduce_sum(Tag::new("all_reduce", 0), &mut x).unwrap_err().to_string()
        });
        assert!(out[0].contains("rank 1 left the group"), "{}", out[0]);
        assert!(t0.elapsed() < Duration::from_secs(10), "no waiting for the timeout");
    }

    #[test]
    fn solo_is_the_identity() {
        let mut s = Solo;
        let mut x = vec![1.5, 2.5];
        s.all_reduce_sum(Tag::new("all_reduce", 0), &mut x).unwrap();
        assert_eq!(x, vec![1.5, 2.5]);
        assert_eq!(s.all_gather(Tag::new("g", 0), &x, &[2]).unwrap(), x);
        assert!(s.all_gather(Tag::new("g", 0), &x, &[3]).is_err());
    }
}
