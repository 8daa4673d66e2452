//! [`IpcEvent`] and [`IpcEventHandle`]: events that order work across processes.

use cumem_core::{Context, Error, Result, Stream};
use cumem_sys::sys::CUevent;

use crate::ffi::{self, HANDLE_SIZE};

/// An event another process can open (created with `CU_EVENT_INTERPROCESS |
/// CU_EVENT_DISABLE_TIMING`, so it cannot time). Recordings made in any process that holds it
/// are seen by all of them: the latest one is what [`IpcEvent::synchronize`],
/// [`IpcEvent::query`] and [`IpcEvent::wait_on`] wait for.
pub struct IpcEvent {
    ctx: Context,
    raw: RawEvent,
}

struct RawEvent(CUevent);

// SAFETY: a CUevent is an opaque handle usable from any thread; cumem never dereferences it.
unsafe impl Send for RawEvent {}
// SAFETY: as above; the driver synchronises its own use of the handle.
unsafe impl Sync for RawEvent {}

/// An exported [`IpcEvent`], as bytes another process can receive. Opening them
/// ([`IpcEventHandle::open`]) is `unsafe`: the imported event is usable only while the exporter's
/// lives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcEventHandle {
    raw: [u8; HANDLE_SIZE],
}

impl std::fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IpcEventHandle(..)")
    }
}

impl IpcEvent {
    /// A new exportable event of `ctx`.
    pub fn new(ctx: &Context) -> Result<IpcEvent> {
        ctx.bind()?;
        Ok(IpcEvent { ctx: ctx.clone(), raw: RawEvent(ffi::event_create()?) })
    }

    /// The handle another process opens with [`IpcEventHandle::open`].
    pub fn handle(&self) -> Result<IpcEventHandle> {
        self.ctx.bind()?;
        Ok(IpcEventHandle { raw: ffi::event_handle(self.raw.0)? })
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUevent {
        self.raw.0
    }

    /// The context the event belongs to here.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Captures everything queued on `stream` so far (a stream of the event's context).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.same_context(stream)?;
        self.ctx.bind()?;
        // SAFETY: both handles are alive (owned by `self` and `stream`) and share a context.
        unsafe { ffi::event_record(self.raw.0, stream.raw()) }
    }

    /// Blocks until the latest recording, made in any process, has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is alive (owned by `self`).
        unsafe { ffi::event_synchronize(self.raw.0) }
    }

    /// `true` if the latest recording has completed (or there was none).
    pub fn query(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the event is alive (owned by `self`).
        unsafe { ffi::event_query(self.raw.0) }
    }

    /// Makes work queued on `stream` from now on wait for the latest recording.
    pub fn wait_on(&self, stream: &Stream) -> Result<()> {
        self.same_context(stream)?;
        self.ctx.bind()?;
        // SAFETY: both handles are alive (owned by `self` and `stream`).
        unsafe { ffi::stream_wait_event(stream.raw(), self.raw.0) }
    }

    fn same_context(&self, stream: &Stream) -> Result<()> {
        if stream.context() != &self.ctx {
            return Err(Error::WrongDevice {
                expected: self.ctx.device().ordinal() as i32,
                actual: stream.context().device().ordinal() as i32,
            });
        }
        Ok(())
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind() {
            tracing::warn!(error = %e, "cumem-ipc: cannot bind an event's context; the event leaks");
            return;
        }
        // SAFETY: the event is owned by `self` and destroyed only here.
        if let Err(e) = unsafe { ffi::event_destroy(self.raw.0) } {
            tracing::warn!(error = %e, "cumem-ipc: cuEventDestroy failed");
        }
    }
}

impl std::fmt::Debug for IpcEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcEvent").field("raw", &self.raw.0).finish()
    }
}

impl IpcEventHandle {
    /// Length of [`IpcEventHandle::to_bytes`].
    pub const ENCODED_LEN: usize = HANDLE_SIZE;

    /// The bytes to send to the other process.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        self.raw
    }

    /// Reads what [`IpcEventHandle::to_bytes`] wrote; any other length gives
    /// [`Error::LengthMismatch`].
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcEventHandle> {
        match <[u8; HANDLE_SIZE]>::try_from(bytes) {
            Ok(raw) => Ok(IpcEventHandle { raw }),
            Err(_) => Err(Error::LengthMismatch { expected: HANDLE_SIZE, actual: bytes.len() }),
        }
    }

    /// Opens the exported event in `ctx`. In the exporting process the simulator answers
    /// [`Error::InvalidContext`], as the H100 does for memory handles (for event handles this is
    /// the simulator's choice, not measured on a GPU); bytes that name no event,
    /// [`Error::InvalidValue`] (the simulator's answer; on a GPU what a forged handle does is
    /// undocumented). Dropping the
    /// returned [`IpcEvent`] destroys this process's import only; the exporter's event lives on.
    ///
    /// # Safety
    ///
    /// The driver documents that operating on an imported event after the exported event was
    /// destroyed (`cuEventDestroy`) is undefined behaviour, and nothing here can see the other
    /// process's event, so the caller promises:
    ///
    /// 1. The exporting [`IpcEvent`] outlives the returned one and every operation on it
    ///    ([`IpcEvent::record`], [`IpcEvent::synchronize`], [`IpcEvent::query`],
    ///    [`IpcEvent::wait_on`], and work queued on a stream behind a `wait_on`): the exporter
    ///    drops its event only after this process says it dropped its import and that work
    ///    completed.
    /// 2. The bytes came from [`IpcEvent::handle`] of that event (through
    ///    [`IpcEventHandle::to_bytes`] / [`IpcEventHandle::from_bytes`]), unaltered: bytes made
    ///    up or changed reach the driver unchecked.
    ///
    /// Safe code cannot open an event:
    ///
    /// ```compile_fail,E0133
    /// fn open_it(handle: &cumem_ipc::IpcEventHandle, ctx: &cumem_core::Context) {
    ///     let _ = handle.open(ctx);
    /// }
    /// ```
    pub unsafe fn open(&self, ctx: &Context) -> Result<IpcEvent> {
        ctx.bind()?;
        Ok(IpcEvent { ctx: ctx.clone(), raw: RawEvent(ffi::event_open(self.raw)?) })
    }
}
