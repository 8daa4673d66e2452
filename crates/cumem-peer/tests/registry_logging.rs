//! Peer access logs with its registry's lock let go: a tracing subscriber may ask
//! `PeerAccess::is_enabled` from inside an event (here, on every event) without deadlocking the
//! thread that logs. The events are the adoption of a pair enabled outside cumem (`debug`), a
//! failed disable when the last guard drops (`warn`, the failure injected: simulator only) and a
//! pair found disabled outside cumem when the last guard drops (`warn`). Each
//! test runs under a watchdog, since the bug hangs rather than fails.

use std::sync::{Arc, Mutex};

use cumem_core::{Context, Device};
use cumem_peer::PeerAccess;
use cumem_sys::sim_control::FaultRule;
use cumem_sys::sys::{self, CUresult};
use cumem_sys::testing::{self, OnEvent, within_watchdog};
use serial_test::serial;
use tracing::field::{Field, Visit};
use tracing::{Event, Level};

const SIM: &str = "devices=2,peer=0-1";

/// One event: its level, its fields as text, and what `is_enabled` answered from inside it.
#[derive(Debug, Clone)]
struct Seen {
    level: Level,
    fields: Vec<(String, String)>,
    enabled: bool,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A subscriber that asks the registry about (`from`, `to`) on every event it receives.
#[derive(Clone)]
struct AsksRegistry {
    from: Context,
    to: Context,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl AsksRegistry {
    fn new(from: &Context, to: &Context) -> Self {
        AsksRegistry { from: from.clone(), to: to.clone(), seen: Arc::default() }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_string(), format!("{value:?}")));
    }
}

impl AsksRegistry {
    /// A subscriber that records every event here, with what `is_enabled` answered inside it.
    fn subscriber(&self) -> OnEvent<impl Fn(&Event<'_>) + Send + Sync + 'static> {
        let this = self.clone();
        OnEvent(move |event: &Event<'_>| {
            let enabled = PeerAccess::is_enabled(&this.from, &this.to);
            let mut fields = Vec::new();
            event.record(&mut Fields(&mut fields));
            this.seen.lock().unwrap().push(Seen { level: *event.metadata().level(), fields, enabled });
        })
    }
}

/// The primary contexts of devices 0 and 1, or `None` (with a message) when they have no link.
fn pair() -> Option<(Context, Context)> {
    testing::init_with(SIM);
    if !testing::needs_devices(2) {
        return None;
    }
    let (a, b) = (Device::get(0).unwrap().context().unwrap(), Device::get(1).unwrap().context().unwrap());
    if !cumem_peer::Topology::probe().unwrap().can_access(0, 1) {
        testing::skip("devices 0 and 1 have no peer link");
        return None;
    }
    Some((a, b))
}

/// `cuCtxEnablePeerAccess` from `from` to `to`, behind cumem's back; it must succeed.
#[track_caller]
fn enable_outside_cumem(from: &Context, to: &Context) {
    from.bind().unwrap();
    // SAFETY: plain FFI call with a live context current.
    let outside = unsafe { sys::cuCtxEnablePeerAccess(to.raw(), 0) };
    assert_eq!(outside, CUresult::CUDA_SUCCESS);
}

/// `cuCtxDisablePeerAccess` from `from` to `to`, behind cumem's back.
fn raw_disable(from: &Context, to: &Context) -> CUresult {
    from.bind().unwrap();
    // SAFETY: plain FFI call with a live context current.
    unsafe { sys::cuCtxDisablePeerAccess(to.raw()) }
}

#[test]
#[serial] // enables and disables peer access between devices 0 and 1
fn adopting_a_pair_logs_to_a_subscriber_that_asks_the_registry() {
    let Some((a, b)) = pair() else { return };
    within_watchdog("enable adopting a pair, with a subscriber asking is_enabled", move || {
        enable_outside_cumem(&a, &b);
        let subscriber = AsksRegistry::new(&a, &b);
        let guard =
            cumem_sys::testing::with_subscriber(subscriber.subscriber(), || PeerAccess::enable(&a, &b))
                .unwrap();
        let seen = subscriber.seen();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].level, Level::DEBUG);
        assert_eq!((seen[0].field("from"), seen[0].field("to")), (Some("0"), Some("1")), "{seen:?}");
        assert!(seen[0].enabled, "the adopted pair was not registered when its event came: {seen:?}");
        // The last guard of an adopted pair leaves it enabled, and logs nothing.
        cumem_sys::testing::with_subscriber(subscriber.subscriber(), || drop(guard));
        assert_eq!(subscriber.seen().len(), 1, "{:?}", subscriber.seen());
        assert!(!PeerAccess::is_enabled(&a, &b));
        assert_eq!(raw_disable(&a, &b), CUresult::CUDA_SUCCESS, "cumem disabled a pair it adopted");
    });
}

#[test]
#[serial] // enables and disables peer access between devices 0 and 1
fn a_failed_disable_logs_to_a_subscriber_that_asks_the_registry() {
    let Some((a, b)) = pair() else { return };
    let Some(ctl) = testing::sim_control() else {
        return testing::skip("injects a driver fault: simulator only");
    };
    within_watchdog("a failed disable, with a subscriber asking is_enabled", move || {
        let guard = PeerAccess::enable(&a, &b).unwrap();
        let subscriber = AsksRegistry::new(&a, &b);
        // Thread-scoped: only this drop's disable fails.
        let rule = ctl.inject_fault(FaultRule {
            function: "cuCtxDisablePeerAccess".into(),
            nth: 1,
            code: CUresult::CUDA_ERROR_LAUNCH_FAILED,
            times: 1,
            this_thread_only: true,
        });
        cumem_sys::testing::with_subscriber(subscriber.subscriber(), || drop(guard));
        ctl.remove_fault(rule);
        let seen = subscriber.seen();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].level, Level::WARN);
        assert_eq!((seen[0].field("from"), seen[0].field("to")), (Some("0"), Some("1")), "{seen:?}");
        assert!(seen[0].field("error").is_some_and(|e| e.contains("LAUNCH_FAILED")), "{seen:?}");
        assert!(seen[0].enabled, "the pair whose disable failed left the registry: {seen:?}");
        // Still cumem's: the next last guard disables it.
        drop(PeerAccess::enable(&a, &b).unwrap());
        assert!(!PeerAccess::is_enabled(&a, &b));
        assert_eq!(
            raw_disable(&a, &b),
            CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
            "cumem left the pair enabled"
        );
    });
}

#[test]
#[serial] // enables and disables peer access between devices 0 and 1
fn a_pair_disabled_outside_cumem_is_forgotten_by_its_last_guard_and_enabled_by_the_next() {
    let Some((a, b)) = pair() else { return };
    within_watchdog("a pair disabled outside cumem, with a subscriber asking is_enabled", move || {
        let guard = PeerAccess::enable(&a, &b).unwrap();
        assert_eq!(raw_disable(&a, &b), CUresult::CUDA_SUCCESS, "cumem did not enable the pair");
        let subscriber = AsksRegistry::new(&a, &b);
        // Its disable finds the pair not enabled: the state it wanted.
        cumem_sys::testing::with_subscriber(subscriber.subscriber(), || drop(guard));
        let seen = subscriber.seen();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].level, Level::WARN);
        assert_eq!((seen[0].field("from"), seen[0].field("to")), (Some("0"), Some("1")), "{seen:?}");
        assert!(!seen[0].enabled, "the pair disabled outside cumem is still registered: {seen:?}");
        assert!(!PeerAccess::is_enabled(&a, &b));
        // The next guard enables the pair again, in the driver too.
        let again = PeerAccess::enable(&a, &b).unwrap();
        assert!(PeerAccess::is_enabled(&a, &b));
        a.bind().unwrap();
        // SAFETY: plain FFI call with a live context current.
        let enabled = unsafe { sys::cuCtxEnablePeerAccess(b.raw(), 0) };
        assert_eq!(
            enabled,
            CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
            "the next guard did not enable"
        );
        drop(again);
        assert!(!PeerAccess::is_enabled(&a, &b));
        assert_eq!(
            raw_disable(&a, &b),
            CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
            "cumem left the pair enabled"
        );
    });
}

/// A subscriber that panics on every event.
fn panics() -> OnEvent<impl Fn(&Event<'_>) + Send + Sync + 'static> {
    OnEvent(|_: &Event<'_>| panic!("a subscriber that panics on every event"))
}

#[test]
#[serial] // enables and disables peer access between devices 0 and 1
fn a_subscriber_panicking_on_the_adoption_event_leaves_no_pair_registered() {
    let Some((a, b)) = pair() else { return };
    within_watchdog("enable adopting a pair, with a subscriber that panics", move || {
        enable_outside_cumem(&a, &b);
        let enabled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cumem_sys::testing::with_subscriber(panics(), || PeerAccess::enable(&a, &b))
        }));
        assert!(enabled.is_err(), "the subscriber did not panic on the adoption event");
        assert!(!PeerAccess::is_enabled(&a, &b), "the guard lost to the panic is still counted");
        // A later guard is the pair's only one: its drop leaves the registry empty.
        drop(PeerAccess::enable(&a, &b).unwrap());
        assert!(!PeerAccess::is_enabled(&a, &b), "a guard lost to the panic is still counted");
        assert_eq!(raw_disable(&a, &b), CUresult::CUDA_SUCCESS, "cumem disabled a pair it adopted");
    });
}
