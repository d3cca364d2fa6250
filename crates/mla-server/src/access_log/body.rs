//! A response body that carries its request's access line: the line is written when the body
//! is dropped, after the body's own contents (a stream owns its generation, which reports its
//! token counts as it drops). Read to its end it is a finished response; dropped before that
//! (hyper drops it when the client goes away) it is an aborted one.

use super::line::PendingLine;
use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

pub(super) struct LoggedBody {
    // Fields drop in declaration order: the body (and the generation a stream owns) before
    // the line, so the line sees the generation's final counts.
    inner: Body,
    line: PendingLine,
}

impl LoggedBody {
    pub fn new(inner: Body, line: PendingLine) -> Self {
        LoggedBody { inner, line }
    }
}

impl http_body::Body for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.line.ended();
        }
        polled
    }

    /// hyper asks this instead of polling for the end when it can (an empty body, or after the
    /// last bytes of one whose length is known), so a `true` here is the end as well.
    fn is_end_stream(&self) -> bool {
        let end = self.inner.is_end_stream();
        if end {
            self.line.ended();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
