//! [`HomeStream`]: a stream of a resource's own context on which its stream-ordered frees follow a
//! buffer's last stream when that stream belongs to another context.
//!
//! A buffer used last on a peer device's stream hands that stream to its resource's `deallocate`.
//! A driver pool cannot simply free on it: the legacy stream's handle (NULL) names the *current*
//! context's legacy stream, not the peer's (driver brief G2), and nothing on record says
//! `cuMemFreeAsync` takes another context's stream. The free goes instead to a stream of the
//! pool's context made to wait for the foreign stream's work so far.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, HomeStream, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let home = HomeStream::new();
//! let other = Stream::non_blocking(&ctx)?; // on a real system, another device's stream
//! let follower = home.after(&ctx, &other).expect("ordered");
//! assert_eq!(follower.context(), &ctx);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use std::sync::OnceLock;

use crate::{Context, Stream};

/// A non-blocking stream of one context, created at first need and kept, that work of other
/// contexts' streams is handed over to (see the module docs).
#[derive(Debug, Default)]
pub struct HomeStream(OnceLock<Stream>);

impl HomeStream {
    /// No stream yet: the first [`after`](Self::after) creates it.
    pub const fn new() -> Self {
        HomeStream(OnceLock::new())
    }

    /// A stream of `ctx` on which work queued next follows `foreign`'s work so far: this home
    /// stream, made to wait for `foreign`. If the wait cannot be queued, `foreign` is synchronised
    /// (its work is then over) and `ctx`'s legacy stream is answered; if that fails too, `None`:
    /// nothing proves the work over (both failures are warned about). `ctx` should be the same on
    /// every call: the home stream is made in the first call's context, and a call with another
    /// context takes the synchronising way.
    pub fn after(&self, ctx: &Context, foreign: &Stream) -> Option<Stream> {
        let home = match self.0.get() {
            Some(home) => Ok(home),
            // A thread that raced this one keeps its stream; this one's is destroyed unused.
            None => Stream::non_blocking(ctx).map(|made| self.0.get_or_init(|| made)),
        };
        let ordered = home.and_then(|home| {
            // Made for the first call's context: another context gets the fallback below.
            if home.context() != ctx {
                return Err(crate::Error::WrongDevice {
                    expected: home.context().device().ordinal() as i32,
                    actual: ctx.device().ordinal() as i32,
                });
            }
            home.wait_for(foreign).map(|()| home)
        });
        match ordered {
            Ok(home) => Some(home.clone()),
            Err(e) => {
                tracing::warn!(error = %e, "ordering after another context's stream failed; waiting for that stream");
                match foreign.synchronize() {
                    Ok(()) => Some(Stream::legacy(ctx)),
                    Err(e) => {
                        tracing::warn!(error = %e, "waiting for another context's stream failed");
                        None
                    }
                }
            }
        }
    }
}
