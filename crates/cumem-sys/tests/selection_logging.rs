//! Selection logs with its lock let go: a tracing subscriber that calls `driver::init()` from
//! inside the events of a selection gets the driver in use instead of deadlocking the selecting
//! thread. In a binary of its own (the driver is chosen once per process), under a watchdog since
//! the bug hangs rather than fails.

use std::sync::{Arc, Mutex};

use cumem_sys::driver::{self, DriverChoice, DriverKind};
use cumem_sys::testing::{self, OnEvent, event_message, within_watchdog};
use tracing::{Event, Level};

/// One event: its level, its message, and what `driver::init()` answered from inside it.
#[derive(Debug, Clone)]
struct Seen {
    level: Level,
    message: String,
    init: Option<DriverKind>,
}

#[derive(Clone, Default)]
struct CallsInit(Arc<Mutex<Vec<Seen>>>);

impl CallsInit {
    /// A subscriber that records every event here, with what `driver::init()` answered inside it.
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let seen = self.0.clone();
        OnEvent(move |event: &Event<'_>| {
            let init = driver::init().ok();
            seen.lock().unwrap().push(Seen {
                level: *event.metadata().level(),
                message: event_message(event),
                init,
            });
        })
    }
}

#[test]
fn a_subscriber_calling_init_during_selection_gets_the_driver_in_use() {
    within_watchdog("a selection, with a subscriber calling driver::init", || {
        let subscriber = CallsInit::default();
        // `Auto` whatever `CUMEM_DRIVER` says: it also logs that no real driver was usable, where
        // there is none. The events come once the selection is made, and `init()` reads
        // `CUMEM_DRIVER` only while none is, so on a GPU machine with `CUMEM_DRIVER=sim` this
        // selects the real driver and `init()` answers it too.
        let kind = cumem_sys::testing::with_subscriber(subscriber.subscriber(), || {
            driver::select_with_sim_config(DriverChoice::Auto, Some(testing::DEFAULT_SIM_CONFIG))
        })
        .unwrap();
        let seen = subscriber.0.lock().unwrap().clone();
        let last = seen.last().expect("the selection logged");
        assert_eq!((last.level, last.message.as_str()), (Level::INFO, "CUDA driver initialised"), "{seen:?}");
        assert!(
            seen.iter().all(|s| s.init == Some(kind)),
            "init() answered differently inside an event: {seen:?}"
        );
        assert_eq!(driver::init().unwrap(), kind);
    });
}
