//! The allocation strategies `cumem replay` and `cumem bench` compare, and the one place they are listed.

use std::sync::Arc;

use clap::ValueEnum;
use cumem::prelude::*;
use cumem::{DriverResource, Result};
use plotters::style::RGBColor;

/// An allocator to compare, as named on the command line (`--pool caching,native,driver`).
///
/// A new strategy is added here only: a variant, its entry in [`Strategy::ALL`], and its arm in each
/// method below. For the caching pool with expandable segments that is `CachingExpandable`
/// (clap names it `caching-expandable`), named `"caching-expandable"`, built by
/// `CachingResource::with_driver(ctx, PoolConfig { expandable_segments: true, ..PoolConfig::default() })`,
/// with a colour of its own (add it to `STRATEGY_COLORS` in `tests/cli.rs` so the chart test checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Strategy {
    /// cumem's caching pool (`CachingResource`) over `cuMemAlloc`, default configuration.
    Caching,
    /// The driver's stream-ordered pool (`cuMemAllocAsync` from a created `MemPool`).
    Native,
    /// `cuMemAlloc`/`cuMemFree` for every allocation (`DriverResource`).
    Driver,
}

impl Strategy {
    /// Every strategy, in the order tables and charts list them.
    pub const ALL: [Strategy; 3] = [Strategy::Caching, Strategy::Native, Strategy::Driver];

    /// The name used on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Caching => "caching",
            Strategy::Native => "native",
            Strategy::Driver => "driver",
        }
    }

    /// A fresh resource of this strategy on `ctx`, holding no memory yet.
    pub fn resource(self, ctx: &Context) -> Result<Arc<dyn DeviceResource>> {
        Ok(match self {
            Strategy::Caching => Arc::new(CachingResource::with_driver(ctx, PoolConfig::default())),
            Strategy::Native => Arc::new(NativePoolResource::new(MemPool::create(ctx, Default::default())?)),
            Strategy::Driver => Arc::new(DriverResource::new(ctx)),
        })
    }

    /// Its colour in charts (distinct, and tested to be drawn).
    pub fn color(self) -> RGBColor {
        match self {
            Strategy::Caching => RGBColor(0x1f, 0x77, 0xb4),
            Strategy::Native => RGBColor(0xd6, 0x27, 0x28),
            Strategy::Driver => RGBColor(0x2c, 0xa0, 0x2c),
        }
    }
}
