//! A group's step as the ranks get it (`NodeStep`), and the two ends of a group that spans nodes:
//! `RemoteNode` is node 0's handle on another node's ranks, `serve_node` is that node's loop.
//! They talk over the link the rendezvous left open (`cluster::rendezvous`).

use super::collect::{collect, Failure, LocalRank, Participant};
use super::Aborter;
use crate::runtime::agreement::StepAgreement;
use crate::runtime::cluster::NodeLink;
use crate::runtime::step_thread::{StepRunner, StepShape, StepSize, StepThread};
use crate::step::backend::CacheLayout;
use crate::step::limits::StepLimits;
use crate::step::plan::{StepOutput, StepPlan};
use serde::{Deserialize, Serialize};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What every rank of a group gets for one step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStep {
    /// One plan per attention rank (one under tensor parallelism).
    pub plans: Arc<Vec<StepPlan>>,
    /// DP attention's agreement (graph bucket, or the ranks' token counts).
    pub agreed: Option<StepAgreement>,
}

impl StepSize for NodeStep {
    fn size(&self) -> StepShape {
        self.plans.as_ref().size()
    }
}

impl NodeStep {
    /// Rank `rank`'s plan: its own under DP attention, the one shared plan otherwise.
    pub fn plan_of(&self, rank: usize) -> &StepPlan {
        if self.plans.len() == 1 {
            &self.plans[0]
        } else {
            &self.plans[rank]
        }
    }

    /// The tokens every attention rank feeds (DP attention's collectives carry them).
    pub fn counts(&self) -> Vec<usize> {
        match &self.agreed {
            Some(StepAgreement::Eager { counts }) => counts.clone(),
            _ => self.plans.iter().map(StepPlan::num_tokens).collect(),
        }
    }
}

/// What a node reports once its ranks are ready: node 0 checks it against its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReady {
    pub ranks: usize,
    /// The KV cache of each of its ranks.
    pub cache: CacheLayout,
    /// Decode batch sizes its ranks captured as graphs (empty on the CPU).
    pub graph_batches: Vec<usize>,
    /// The largest step its ranks were sized for (every node's must be equal).
    pub step_limits: StepLimits,
    /// Its devices, for the log.
    pub describe: String,
}

/// Node 0 to a node.
#[derive(Debug, Serialize, Deserialize)]
pub enum ToNode {
    Step(NodeStep),
    /// A rank failed: abort the collectives and leave.
    Abort,
    /// The server is shutting down.
    Stop,
}

/// A node to node 0.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromNode {
    Ready(NodeReady),
    /// Its ranks' outputs for the step, in rank order.
    Outputs(Vec<StepOutput>),
    Failed(String),
}

/// Node 0's handle on another node: sends it steps, reads its answers on a thread of its own (so
/// a silent node is noticed by the watchdog, never waited on in a read).
pub struct RemoteNode {
    link: NodeLink,
    answers: Receiver<std::io::Result<FromNode>>,
    /// Why the last step could not be sent.
    send_error: Option<String>,
}

impl RemoteNode {
    pub fn new(link: NodeLink) -> anyhow::Result<Self> {
        let mut reader = link.try_clone()?;
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::Builder::new().name(format!("node-{}-reader", link.node)).spawn(move || loop {
            let m = reader.recv::<FromNode>();
            let end = m.is_err();
            if tx.send(m).is_err() || end {
                return;
            }
        })?;
        Ok(RemoteNode { link, answers, send_error: None })
    }

    pub fn node(&self) -> usize {
        self.link.node
    }

    /// Waits for the node's ranks to be ready (they start alongside node 0's).
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<NodeReady> {
        match self.try_ready(timeout)? {
            Some(r) => Ok(r),
            None => anyhow::bail!("node {} was not ready within {:.0} s", self.node(), timeout.as_secs_f64()),
        }
    }

    /// `wait_ready` for at most `wait`: `None` if the node has not answered yet.
    pub fn try_ready(&mut self, wait: Duration) -> anyhow::Result<Option<NodeReady>> {
        let node = self.node();
        match self.answers.recv_timeout(wait) {
            Ok(Ok(FromNode::Ready(r))) => Ok(Some(r)),
            Ok(Ok(FromNode::Failed(why))) => anyhow::bail!("node {node} failed to start: {why}"),
            Ok(Ok(other)) => anyhow::bail!("node {node} sent {other:?} before it was ready"),
            Ok(Err(e)) => anyhow::bail!("node {node} went away while starting: {e}"),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => anyhow::bail!("node {node} went away while starting"),
        }
    }

    pub fn start(&mut self, step: &NodeStep) {
        // A step is sent by reference to its shared plans; the node answers or the send fails.
        self.send_error = self.link.send(&ToNodeRef::Step(step)).err().map(|e| e.to_string());
    }

    /// Best effort: the node may be gone already.
    pub fn abort(&mut self) {
        let _ = self.link.send(&ToNodeRef::Abort);
    }

    pub fn stop(&mut self) {
        let _ = self.link.send(&ToNodeRef::Stop);
    }
}

/// `ToNode` as sent (borrowing the step).
#[derive(Serialize)]
enum ToNodeRef<'a> {
    Step(&'a NodeStep),
    Abort,
    Stop,
}

impl Participant for RemoteNode {
    fn name(&self) -> String {
        format!("node {}", self.node())
    }

    fn poll(&mut self, deadline: Instant) -> Option<Result<Vec<StepOutput>, Failure>> {
        if let Some(e) = self.send_error.take() {
            return Some(Err(Failure::died(format!("cannot send it the step: {e}"))));
        }
        match self.answers.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Ok(FromNode::Outputs(o))) => Some(Ok(o)),
            Ok(Ok(FromNode::Failed(why))) => Some(Err(Failure::failed(why))),
            Ok(Ok(other)) => Some(Err(Failure::failed(format!("unexpected message {other:?}")))),
            Ok(Err(e)) => Some(Err(Failure::died(format!("connection lost: {e}")))),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Err(Failure::died("connection lost".into()))),
        }
    }
}

impl Drop for RemoteNode {
    fn drop(&mut self) {
        self.link.shutdown();
    }
}

/// A node other than 0: reports `ready`, then runs every step node 0 sends on its local ranks
/// (global ranks `first ..`) and answers with their outputs, until node 0 stops it (`Ok`) or
/// aborts, goes away or a rank fails (`Err`, after aborting the local collectives).
pub fn serve_node<W: StepRunner<Step = NodeStep, Output = StepOutput>>(
    mut link: NodeLink,
    mut ranks: Vec<StepThread<W>>,
    first: usize,
    aborters: Vec<Aborter>,
    ready: NodeReady,
    watchdog: Duration,
) -> anyhow::Result<()> {
    let abort_all = |aborters: &[Aborter]| aborters.iter().for_each(|a| spawn_abort(a.clone()));
    link.send(&FromNode::Ready(ready))?;
    let leave = |ranks: Vec<StepThread<W>>, why: String| -> anyhow::Result<()> {
        abort_all(&aborters);
        ranks.into_iter().for_each(StepThread::detach);
        anyhow::bail!(why)
    };
    loop {
        let step = match link.recv::<ToNode>() {
            Ok(ToNode::Step(s)) => Arc::new(s),
            Ok(ToNode::Stop) => return Ok(()),
            Ok(ToNode::Abort) => return leave(ranks, "node 0 stopped the group after a rank failed".into()),
            Err(e) => return leave(ranks, format!("lost node 0: {e}")),
        };
        ranks.iter_mut().for_each(|t| t.start_step(&step));
        let mut locals: Vec<LocalRank<W>> =
            ranks.iter_mut().enumerate().map(|(i, thread)| LocalRank { rank: first + i, thread }).collect();
        let mut parts: Vec<&mut dyn Participant> = locals.iter_mut().map(|l| l as &mut dyn Participant).collect();
        match collect(&mut parts, watchdog, &|| abort_all(&aborters)) {
            Ok(outs) => link.send(&FromNode::Outputs(outs))?,
            Err(why) => {
                let _ = link.send(&FromNode::Failed(why.clone()));
                return leave(ranks, why);
            }
        }
    }
}

/// Runs an aborter on a thread of its own: an abort may block while the device still runs.
pub(crate) fn spawn_abort(a: Aborter) {
    if let Err(e) = std::thread::Builder::new().name("collective-abort".into()).spawn(move || a()) {
        tracing::error!("cannot start a thread to abort a collective: {e}");
    }
}
