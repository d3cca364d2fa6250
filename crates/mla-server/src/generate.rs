//! One HTTP request's generation: the engine streams of its prompts merged, each completion
//! ("choice") detokenized incrementally with stop strings applied, and the updates the two
//! endpoints turn into responses or stream chunks.
//!
//! A stop string ends its choice in the engine too (`RequestStream::finish_choice`), so the
//! engine stops decoding it and frees its blocks while the request's other choices go on.
//! Dropping a `Generation` drops its engine streams, which aborts whatever is still running:
//! that is how a closed client connection reaches the engine. Finish reasons are counted by the
//! engine alone (`/metrics` reads them from its statistics). When a `Generation` is dropped it
//! reports its counts and finish reasons to the request's access-log record, if it has one.

use crate::access_log::{AccessRecord, GenerationOutcome};
use crate::error::ApiError;
use crate::protocol::common::{StopReason, Usage};
use crate::text::{ChoiceText, TextPipeline};
use mla_engine::{EngineEvent, FinishReason, PromptTokenLogprob, RequestStream, TokenLogprobs};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

/// A generated token as clients see it in `logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// Most likely alternatives, best first: (text, bytes, logprob).
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// How generated tokens are reported besides their text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogprobOptions {
    /// Report each token's logprob (with as many alternatives as the engine was asked for).
    pub enabled: bool,
    /// Name tokens `token_id:<id>` instead of by their text (vLLM's
    /// `return_tokens_as_token_ids`), so clients can recover the exact ids.
    pub tokens_as_ids: bool,
}

/// How a choice's end is reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOptions {
    /// The request's own `stop_token_ids`: ending on one of them is its `stop_reason` (EOS is not).
    pub requested_ids: Vec<u32>,
    /// The stop token's text stays in the output (`include_stop_str_in_output`; a special token
    /// is still dropped when `skip_special_tokens`).
    pub include_stop: bool,
}

/// New output of one choice. `text` may be empty (held back while it could start a stop string).
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceUpdate {
    pub index: usize,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    /// With `finish`: the stop string or requested stop token that ended the choice.
    pub stop_reason: Option<StopReason>,
    /// The prompt's logprobs (when asked for), on the choice's first update only.
    pub prompt_logprobs: Option<Arc<Vec<PromptTokenLogprob>>>,
    /// The generated ids this update consumed (counted in `completion_tokens`), whether or not
    /// their text is released yet.
    pub token_ids: Vec<u32>,
    /// With `finish`: the stop token (EOS or a requested one) that ended the choice.
    pub stop_token: Option<u32>,
}

impl ChoiceUpdate {
    fn new(index: usize, text: String, logprobs: Vec<TokenLogprob>) -> Self {
        ChoiceUpdate {
            index,
            text,
            logprobs,
            finish: None,
            stop_reason: None,
            prompt_logprobs: None,
            token_ids: vec![],
            stop_token: None,
        }
    }

    /// SGLang's `matched_stop`: the stop string, else the stop token, that ended the choice.
    pub fn matched_stop(&self) -> Option<StopReason> {
        self.stop_reason.clone().or(self.stop_token.map(StopReason::Token))
    }
}

struct Choice {
    text: ChoiceText,
    completion_tokens: usize,
    finished: bool,
    /// Why it finished, for the access log (None: cut short, or ended by an engine error).
    reason: Option<FinishReason>,
    /// Its first update has gone out (it carries the prompt logprobs).
    started: bool,
}

/// The engine request of one prompt; its completions are choices `base .. base + n`.
struct PromptRun {
    stream: Option<RequestStream>,
    base: usize,
    n: usize,
    stop_token_ids: Vec<u32>,
    /// `EngineEvent::PromptLogprobs`, which comes before the run's first token.
    prompt_logprobs: Option<Arc<Vec<PromptTokenLogprob>>>,
}

pub struct Generation {
    runs: Vec<PromptRun>,
    choices: Vec<Choice>,
    prompt_tokens: usize,
    /// Prompt tokens of all runs the prefix cache held at admission.
    cached_tokens: usize,
    logprobs: LogprobOptions,
    stops: StopOptions,
    text: Arc<TextPipeline>,
    /// Round-robin start so one busy prompt cannot starve the others' updates.
    next_poll: usize,
    /// Updates produced together (several choices closed at once), handed out one by one.
    pending: VecDeque<ChoiceUpdate>,
    /// Where the outcome goes when this is dropped (`report_to`).
    access: Option<AccessRecord>,
    first_token: Option<Instant>,
    /// Resolves when the engine of a live run dies (`engine_death`); built once, not per event,
    /// and dropped when a run ends so that only live runs' engines are watched.
    death: Option<Pin<Box<dyn Future<Output = String> + Send>>>,
    /// The engine reported an error: the choices it cut short failed rather than aborted.
    failed: bool,
}

/// What `Generation::start` needs per prompt: the submitted stream and its request's numbers.
pub struct Submitted {
    pub stream: RequestStream,
    pub prompt_len: usize,
    pub n: usize,
    pub stop_token_ids: Vec<u32>,
}

impl Generation {
    pub fn new(
        submitted: Vec<Submitted>,
        make_text: impl Fn() -> ChoiceText,
        logprobs: LogprobOptions,
        stops: StopOptions,
        text: Arc<TextPipeline>,
    ) -> Self {
        let mut runs = vec![];
        let mut choices = vec![];
        let mut prompt_tokens = 0;
        for s in submitted {
            runs.push(PromptRun {
                stream: Some(s.stream),
                base: choices.len(),
                n: s.n,
                stop_token_ids: s.stop_token_ids,
                prompt_logprobs: None,
            });
            prompt_tokens += s.prompt_len;
            choices.extend((0..s.n).map(|_| Choice {
                text: make_text(),
                completion_tokens: 0,
                finished: false,
                reason: None,
                started: false,
            }));
        }
        Generation {
            runs,
            choices,
            prompt_tokens,
            cached_tokens: 0,
            logprobs,
            stops,
            text,
            next_poll: 0,
            pending: VecDeque::new(),
            access: None,
            first_token: None,
            failed: false,
            death: None,
        }
    }

    /// Reports token counts, finish reasons and the first token's time to `record` once this
    /// generation is dropped: finished, failed, or abandoned with its client.
    pub fn report_to(&mut self, record: AccessRecord) {
        self.access = Some(record);
    }

    pub fn num_choices(&self) -> usize {
        self.choices.len()
    }

    /// Usage so far (final once `next` has returned `None`). The prompt counts once per prompt,
    /// not once per choice, as OpenAI counts it.
    pub fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.choices.iter().map(|c| c.completion_tokens).sum(), self.cached_tokens)
    }

    /// The next update, `None` once every choice has finished, or the engine's error.
    pub async fn next(&mut self) -> Option<Result<ChoiceUpdate, ApiError>> {
        loop {
            if let Some(u) = self.pending.pop_front() {
                return Some(Ok(u));
            }
            if self.death.is_none() {
                self.death = self.engine_death();
            }
            let (run, event) = match self.death.take() {
                // A hung engine sends nothing more; its death (the step watchdog) ends the wait.
                Some(mut died) => {
                    let woke = tokio::select! {
                        biased;
                        event = self.next_event() => event,
                        why = &mut died => Some((0, Some(EngineEvent::Error { message: why }))),
                    };
                    self.death = Some(died);
                    woke?
                }
                None => self.next_event().await?,
            };
            if let Err(e) = self.apply(run, event) {
                self.failed = true;
                self.abort_all();
                return Some(Err(e));
            }
        }
    }

    /// Resolves once the engine of any live run has died, with the reason.
    fn engine_death(&self) -> Option<Pin<Box<dyn Future<Output = String> + Send>>> {
        let deaths: Vec<_> =
            self.runs.iter().filter_map(|r| r.stream.as_ref()).map(|s| Box::pin(s.engine_died())).collect();
        (!deaths.is_empty()).then(|| -> Pin<Box<dyn Future<Output = String> + Send>> {
            Box::pin(async move { futures_util::future::select_all(deaths).await.0 })
        })
    }

    /// Stops listening to run `run` (its choices are done, or its engine went away).
    fn end_run(&mut self, run: usize) {
        self.runs[run].stream = None;
        self.death = None;
    }

    /// Waits for an event from any live run; a closed channel arrives as `None` for that run.
    async fn next_event(&mut self) -> Option<(usize, Option<EngineEvent>)> {
        if self.runs.iter().all(|r| r.stream.is_none()) {
            return None;
        }
        poll_fn(|cx| {
            let len = self.runs.len();
            for k in 0..len {
                let i = (self.next_poll + k) % len;
                if let Some(stream) = &mut self.runs[i].stream {
                    if let Poll::Ready(ev) = stream.events.poll_recv(cx) {
                        self.next_poll = (i + 1) % len;
                        return Poll::Ready(Some((i, ev)));
                    }
                }
            }
            Poll::Pending
        })
        .await
    }

    fn apply(&mut self, run: usize, event: Option<EngineEvent>) -> Result<(), ApiError> {
        let (base, n) = (self.runs[run].base, self.runs[run].n);
        if self.first_token.is_none() && matches!(event, Some(EngineEvent::Token { .. })) {
            self.first_token = Some(Instant::now());
        }
        let update = match event {
            Some(EngineEvent::Token { index, token, logprobs, finish }) if index < n => {
                self.on_token(run, base + index, token, logprobs, finish)
            }
            Some(EngineEvent::Finished { index, reason }) if index < n => self.finish(base + index, reason, vec![]),
            Some(EngineEvent::Admitted { cached_tokens }) => {
                self.cached_tokens += cached_tokens;
                None
            }
            Some(EngineEvent::PromptLogprobs { entries }) => {
                self.runs[run].prompt_logprobs = Some(Arc::new(entries));
                None
            }
            Some(EngineEvent::Error { message }) => return Err(ApiError::Internal(message)),
            // The request's own doing (its grammar): the client's error.
            Some(EngineEvent::Rejected { message }) => return Err(ApiError::InvalidRequest { message, param: None }),
            Some(other) => {
                return Err(ApiError::Internal(format!("engine sent an event for an unknown completion: {other:?}")))
            }
            None => {
                // The engine dropped the request without finishing every choice (it is gone):
                // the rest are reported as aborted.
                self.end_run(run);
                for c in base..base + n {
                    if let Some(u) = self.finish(c, FinishReason::Abort, vec![]) {
                        self.pending.push_back(u);
                    }
                }
                None
            }
        };
        if let Some(u) = update {
            let u = self.first_carries_prompt(run, u);
            self.pending.push_back(u);
        }
        // Every choice of this prompt is done: stop listening. The engine has ended (or been told
        // to end) each of them, so dropping the stream aborts nothing.
        if (base..base + n).all(|c| self.choices[c].finished) {
            self.end_run(run);
        }
        Ok(())
    }

    fn on_token(
        &mut self,
        run: usize,
        c: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        finish: Option<FinishReason>,
    ) -> Option<ChoiceUpdate> {
        let choice = &mut self.choices[c];
        if choice.finished {
            // A stop string already ended this choice; the engine had not seen it yet.
            return None;
        }
        choice.completion_tokens += 1;
        let mut update = self.token_update(run, c, token, logprobs, finish)?;
        update.token_ids.insert(0, token);
        Some(update)
    }

    /// The update for a counted token: its text, and the end of the choice when it ends it.
    fn token_update(
        &mut self,
        run: usize,
        c: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        finish: Option<FinishReason>,
    ) -> Option<ChoiceUpdate> {
        let lp = match (&logprobs, self.logprobs.enabled) {
            (Some(l), true) => vec![self.token_logprob(token, l)],
            _ => vec![],
        };
        // The stop token that ends a completion is counted and has its logprob, but is not text
        // unless `include_stop_str_in_output` asks for it (as in vLLM).
        if let Some(reason) = finish.filter(|_| self.runs[run].stop_token_ids.contains(&token)) {
            let text = if self.stops.include_stop { self.choices[c].text.push(token).0 } else { String::new() };
            let stop_reason = self.stops.requested_ids.contains(&token).then_some(StopReason::Token(token));
            return self
                .finish_with_text(c, reason, text, lp)
                .map(|u| ChoiceUpdate { stop_token: Some(token), ..u.with_stop_reason(stop_reason) });
        }
        let choice = &mut self.choices[c];
        let (text, stop_hit) = choice.text.push(token);
        if let Some(stop) = stop_hit {
            if finish.is_none() {
                // The engine cannot see the stop string: end this completion there as well, so
                // it stops decoding it now instead of when the whole request ends.
                if let Some(stream) = &self.runs[run].stream {
                    stream.finish_choice(c - self.runs[run].base, FinishReason::Stop);
                }
            }
            return self
                .finish_with_text(c, FinishReason::Stop, text, lp)
                .map(|u| u.with_stop_reason(Some(StopReason::Text(stop))));
        }
        match finish {
            Some(reason) => self.finish_with_text(c, reason, text, lp),
            None => Some(ChoiceUpdate::new(c, text, lp)),
        }
    }

    fn finish(&mut self, c: usize, reason: FinishReason, logprobs: Vec<TokenLogprob>) -> Option<ChoiceUpdate> {
        self.finish_with_text(c, reason, String::new(), logprobs)
    }

    /// Ends a choice: flushes held-back text (unless a stop string ended it).
    fn finish_with_text(
        &mut self,
        c: usize,
        reason: FinishReason,
        mut text: String,
        logprobs: Vec<TokenLogprob>,
    ) -> Option<ChoiceUpdate> {
        let choice = &mut self.choices[c];
        if choice.finished {
            return None;
        }
        let (tail, stop_hit) = choice.text.finish();
        text.push_str(&tail);
        // Text released only at the end can still complete a stop string.
        let (reason, stop_reason) = match stop_hit {
            Some(stop) if reason != FinishReason::Abort => (FinishReason::Stop, Some(StopReason::Text(stop))),
            _ => (reason, None),
        };
        choice.finished = true;
        choice.reason = Some(reason);
        Some(ChoiceUpdate { finish: Some(reason), stop_reason, ..ChoiceUpdate::new(c, text, logprobs) })
    }

    fn token_logprob(&self, token: u32, l: &TokenLogprobs) -> TokenLogprob {
        let piece = |id: u32| {
            let (text, bytes) = self.text.token_piece(id);
            if self.logprobs.tokens_as_ids {
                (format!("token_id:{id}"), bytes)
            } else {
                (text, bytes)
            }
        };
        let (text, bytes) = piece(token);
        let top = l
            .top
            .iter()
            .map(|&(t, lp)| {
                let (s, b) = piece(t);
                (s, b, lp)
            })
            .collect();
        TokenLogprob { token: text, bytes, logprob: l.logprob, top }
    }

    /// Gives a choice's first update its run's prompt logprobs.
    fn first_carries_prompt(&mut self, run: usize, mut u: ChoiceUpdate) -> ChoiceUpdate {
        let choice = &mut self.choices[u.index];
        if !choice.started {
            choice.started = true;
            u.prompt_logprobs = self.runs[run].prompt_logprobs.clone();
        }
        u
    }

    /// Drops every engine stream, which aborts whatever still runs (the engine counts those).
    fn abort_all(&mut self) {
        for r in &mut self.runs {
            r.stream = None;
        }
        self.death = None;
        for c in &mut self.choices {
            c.finished = true;
        }
    }
}

impl ChoiceUpdate {
    /// Sets the stop reason unless a stop string found while flushing already did.
    fn with_stop_reason(mut self, reason: Option<StopReason>) -> Self {
        if self.stop_reason.is_none() {
            self.stop_reason = reason;
        }
        self
    }
}

impl Generation {
    /// Each choice's finish reason once, in choice order: `stop`, `stop,length`; choices that
    /// never finished count as `abort` (client gone, shutdown), or `error` if the engine failed.
    fn finish_summary(&self) -> String {
        let unfinished = if self.failed { "error" } else { FinishReason::Abort.as_str() };
        let mut seen: Vec<&str> = Vec::new();
        for c in &self.choices {
            let r = c.reason.map_or(unfinished, |r| r.as_str());
            if !seen.contains(&r) {
                seen.push(r);
            }
        }
        seen.join(",")
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if let Some(record) = self.access.take() {
            let usage = self.usage();
            record.generation_ended(GenerationOutcome {
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.prompt_tokens_details.cached_tokens,
                finish: self.finish_summary(),
                first_token: self.first_token,
            });
        }
    }
}
