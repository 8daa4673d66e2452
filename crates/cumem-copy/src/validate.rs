//! Checks every transfer makes before the driver is called: lengths and devices.

use cumem_core::{Context, Error, Result, Stream};

pub(crate) fn same_len(dst: usize, src: usize) -> Result<()> {
    if dst == src { Ok(()) } else { Err(Error::LengthMismatch { expected: dst, actual: src }) }
}

pub(crate) fn same_device(expected: &Context, actual: &Context) -> Result<()> {
    if expected.device() == actual.device() {
        Ok(())
    } else {
        Err(Error::WrongDevice {
            expected: expected.device().ordinal() as i32,
            actual: actual.device().ordinal() as i32,
        })
    }
}

pub(crate) fn on_stream_device(stream: &Stream, memory: &Context) -> Result<()> {
    same_device(stream.context(), memory)
}
