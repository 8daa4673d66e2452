//! Adaptors compose in any order: each of the 120 orders of the five adaptors (statistics,
//! limiting, tracking, logging, failure callback) stacked over one caching pool serves a workload
//! with its data intact, every layer sees each allocation and free that passes through it, and a
//! request over the cap is `OutOfMemory` with a report naming the cap wherever the limiting adaptor
//! sits. The layers above the cap see that failure (the callback is asked once and gives up, the
//! log has an `allocate failure` row); the layers below it never see the request.

use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cumem_core::{Device, DeviceBuffer, DeviceResource, Error, Stream};
use cumem_pool::trace_format::{TraceAction, parse_trace};
use cumem_pool::{
    CachingResource, FailureCallbackResource, LimitingResource, LoggingResource, PoolConfig,
    StatisticsResource, TrackingResource,
};
use cumem_sys::testing;
use parking_lot::Mutex;
use serial_test::parallel;

/// The cap of every stack's limiting adaptor.
const CAP: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layer {
    Statistics,
    Limiting,
    Tracking,
    Logging,
    Callback,
}

const LAYERS: [Layer; 5] =
    [Layer::Statistics, Layer::Limiting, Layer::Tracking, Layer::Logging, Layer::Callback];

/// An output the test reads while the logging adaptor still owns the writer.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Every order of `items`.
fn permutations(items: &[Layer]) -> Vec<Vec<Layer>> {
    if items.is_empty() {
        return vec![Vec::new()];
    }
    let mut all = Vec::new();
    for (i, &first) in items.iter().enumerate() {
        let mut rest = items.to_vec();
        rest.remove(i);
        for mut tail in permutations(&rest) {
            tail.insert(0, first);
            all.push(tail);
        }
    }
    all
}

/// One stack, bottom (over the pool) to top, with a handle on each layer.
struct Stack {
    top: Arc<dyn DeviceResource>,
    stats: Arc<StatisticsResource>,
    limit: Arc<LimitingResource<dyn DeviceResource>>,
    tracker: Arc<TrackingResource<dyn DeviceResource>>,
    log: Arc<LoggingResource<dyn DeviceResource>>,
    out: Shared,
    asked: Arc<AtomicUsize>,
}

fn stack(pool: &Arc<CachingResource>, order: &[Layer]) -> Stack {
    let mut below: Arc<dyn DeviceResource> = pool.clone();
    let (mut stats, mut limit, mut tracker, mut log) = (None, None, None, None);
    let out = Shared::default();
    let asked = Arc::new(AtomicUsize::new(0));
    for layer in order {
        below = match layer {
            Layer::Statistics => {
                let a = Arc::new(StatisticsResource::new(below));
                stats = Some(a.clone());
                a
            }
            Layer::Limiting => {
                let a = Arc::new(LimitingResource::new(below, CAP));
                limit = Some(a.clone());
                a
            }
            Layer::Tracking => {
                let a = Arc::new(TrackingResource::new(below));
                tracker = Some(a.clone());
                a
            }
            Layer::Logging => {
                let a = Arc::new(LoggingResource::new(below, out.clone()).unwrap());
                log = Some(a.clone());
                a
            }
            Layer::Callback => {
                let asked = asked.clone();
                Arc::new(FailureCallbackResource::new(below, 3, move |failure| {
                    assert_eq!(failure.bytes, CAP);
                    asked.fetch_add(1, Ordering::Relaxed);
                    false // nothing to free: give up
                }))
            }
        };
    }
    Stack {
        top: below,
        stats: stats.unwrap(),
        limit: limit.unwrap(),
        tracker: tracker.unwrap(),
        log: log.unwrap(),
        out,
        asked,
    }
}

#[test]
#[parallel]
fn every_order_of_the_five_adaptors_serves_counts_and_refuses_alike() {
    testing::init();
    let ctx = Device::get(0).unwrap().context().unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let pool = Arc::new(CachingResource::with_driver(&ctx, PoolConfig::default()));
    let orders = permutations(&LAYERS);
    assert_eq!(orders.len(), 120);
    let data: Vec<u32> = (0..1000).collect();
    for order in &orders {
        let position = |layer| order.iter().position(|&l| l == layer).unwrap();
        let above_cap = |layer| position(layer) > position(Layer::Limiting);
        let st = stack(&pool, order);

        let a = DeviceBuffer::<u32>::from_slice_in(&st.top, &s, &data).unwrap();
        let b = DeviceBuffer::<u8>::zeroed_in(&st.top, &s, 8000).unwrap();
        assert_eq!(a.to_vec().unwrap(), data, "{order:?}");
        assert_eq!(b.to_vec().unwrap(), vec![0u8; 8000], "{order:?}");
        let err = DeviceBuffer::<u8>::zeroed_in(&st.top, &s, CAP).unwrap_err();
        let Error::OutOfMemory { report: Some(report), .. } = &err else {
            panic!("{order:?}: expected OutOfMemory with a report, got {err:?}")
        };
        assert_eq!(
            (report.requested, report.allocated, report.reserved),
            (CAP as u64, 12_000, CAP as u64),
            "{order:?}: the report names the cap"
        );

        assert_eq!(st.limit.used(), 12_000, "{order:?}");
        let counters = st.stats.counters();
        assert_eq!((counters.current_bytes, counters.total_count), (12_000, 2), "{order:?}");
        assert_eq!((st.tracker.live_count(), st.tracker.live_bytes()), (2, 12_000), "{order:?}");
        let asked = usize::from(above_cap(Layer::Callback));
        assert_eq!(st.asked.load(Ordering::Relaxed), asked, "{order:?}: the callback sees the cap's refusal");

        drop((a, b));
        st.log.flush().unwrap();
        let rows = parse_trace(st.out.0.lock().as_slice()).unwrap();
        let actions: Vec<_> = rows.iter().map(|r| (r.action, r.size)).collect();
        let mut expected = vec![(TraceAction::Allocate, 4000), (TraceAction::Allocate, 8000)];
        if above_cap(Layer::Logging) {
            expected.push((TraceAction::AllocateFailure, CAP));
        }
        expected.extend([(TraceAction::Free, 4000), (TraceAction::Free, 8000)]);
        assert_eq!(actions, expected, "{order:?}");
        assert_eq!(rows[0].pointer, rows[rows.len() - 2].pointer, "{order:?}: the log names the pointers");

        assert_eq!(st.limit.used(), 0, "{order:?}");
        assert_eq!(st.stats.counters().current_bytes, 0, "{order:?}");
        assert_eq!(st.tracker.live_count(), 0, "{order:?}");
        assert_eq!(pool.stats().current_bytes, 0, "{order:?}: everything went back to the pool");
    }
}
