//! Every peer copy reports its path as a `debug` event of target `cumem_peer`, with the devices,
//! the byte count and the path, so that a staged copy is visible in logs as well as in the
//! returned value.

use std::sync::{Arc, Mutex};

use cumem_core::{Device, DeviceBuffer, Stream};
use cumem_peer::{PeerPath, copy_peer};
use cumem_sys::testing;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// One event: its level and its fields as text.
type Captured = (Level, Vec<(String, String)>);

/// Captured events of target `cumem_peer`.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Captured>>>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_string(), format!("{value:?}")));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        if event.metadata().target() != "cumem_peer" {
            return;
        }
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push((*event.metadata().level(), fields));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn a_staged_copy_is_reported_with_its_devices_and_bytes() {
    testing::init_with("devices=3,peer=0-1");
    if !testing::needs_devices(3) {
        return;
    }
    let ctx: Vec<_> = (0..3).map(|d| Device::get(d).unwrap().context().unwrap()).collect();
    let src = DeviceBuffer::from_slice(&Stream::new(&ctx[0]).unwrap(), &[3u16; 100]).unwrap();
    let mut dst = DeviceBuffer::<u16>::zeroed(&Stream::new(&ctx[2]).unwrap(), 100).unwrap();
    let capture = Capture::default();
    let done = cumem_sys::testing::with_subscriber(capture.clone(), || copy_peer(&src, &mut dst)).unwrap();
    let events = capture.0.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    let (level, fields) = &events[0];
    assert_eq!(*level, Level::DEBUG);
    let field = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let path = format!("{:?}", done.path());
    assert_eq!(done.path(), PeerPath::Staged);
    assert_eq!(field("path").as_deref(), Some(path.as_str()));
    assert_eq!(field("src_device").as_deref(), Some("0"));
    assert_eq!(field("dst_device").as_deref(), Some("2"));
    assert_eq!(field("bytes").as_deref(), Some("200"));
    assert_eq!(dst.to_vec().unwrap(), [3; 100]);
}
