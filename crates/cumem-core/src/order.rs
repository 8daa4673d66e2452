//! Stream ordering of device memory: the last stream a buffer was used on.
//!
//! Device work on one stream is unordered with work on another. When a buffer last used on stream
//! A is next used on stream B, B must first wait for A's work so far; this tracker does that (an
//! event recorded on A, waited on by B) and remembers B. Frees go to the resource on the last
//! stream, which is what lets stream-ordered pools reuse memory safely.
//!
//! ```
//! # cumem_sys::testing::init();
//! use cumem_core::{Device, StreamOrder, Stream};
//! let ctx = Device::get(0)?.context()?;
//! let (a, b) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
//! let order = StreamOrder::new(&a);
//! order.use_on(&b)?; // b now waits for everything queued on a so far
//! assert_eq!(order.last(), b);
//! # Ok::<(), cumem_core::Error>(())
//! ```

use parking_lot::Mutex;

use crate::{Result, Stream};

/// The stream that device memory was last used on.
#[derive(Debug)]
pub struct StreamOrder {
    last: Mutex<Stream>,
}

impl StreamOrder {
    /// Memory first used (allocated) on `stream`.
    pub fn new(stream: &Stream) -> Self {
        StreamOrder { last: Mutex::new(stream.clone()) }
    }

    /// Orders `stream` after all work queued so far on the last stream, and makes `stream` the last.
    /// Call before queueing work that uses the memory on `stream`.
    pub fn use_on(&self, stream: &Stream) -> Result<()> {
        let mut last = self.last.lock();
        if *last != *stream {
            stream.wait_for(&last)?;
            *last = stream.clone();
        }
        Ok(())
    }

    /// The stream the memory was last used on.
    pub fn last(&self) -> Stream {
        self.last.lock().clone()
    }
}
