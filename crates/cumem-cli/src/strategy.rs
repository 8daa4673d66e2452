//! The allocation strategies `cumem replay` and `cumem bench` compare, and the one place they are listed.

use std::sync::Arc;

use clap::ValueEnum;
use cumem::prelude::*;
use cumem::{DriverResource, Result};
use plotters::style::RGBColor;

/// An allocator to compare, as named on the command line (`--pool caching,caching-expandable,native,driver`).
///
/// A new strategy is added here only: a variant, its entry in [`Strategy::ALL`], and its arm in each
/// method below (and its colour in `STRATEGY_COLORS` in `tests/cli.rs`, so the chart test checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Strategy {
    /// cumem's caching pool (`CachingResource`) over `cuMemAlloc`, default configuration.
    Caching,
    /// The caching pool with expandable segments: one VMM-backed segment per stream that grows by
    /// mapping chunks (`PoolConfig::expandable_segments`; ordinary segments on a device without VMM).
    CachingExpandable,
    /// The driver's stream-ordered pool (`cuMemAllocAsync` from a created `MemPool`).
    Native,
    /// `cuMemAlloc`/`cuMemFree` for every allocation (`DriverResource`).
    Driver,
}

impl Strategy {
    /// Every strategy, in the order tables and charts list them.
    pub const ALL: [Strategy; 4] =
        [Strategy::Caching, Strategy::CachingExpandable, Strategy::Native, Strategy::Driver];

    /// The width of the longest [`name`](Strategy::name), for the tables' first column.
    pub const NAME_WIDTH: usize = 18;

    /// The name used on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Caching => "caching",
            Strategy::CachingExpandable => "caching-expandable",
            Strategy::Native => "native",
            Strategy::Driver => "driver",
        }
    }

    /// A fresh resource of this strategy on `ctx`, holding no memory yet.
    pub fn resource(self, ctx: &Context) -> Result<Arc<dyn DeviceResource>> {
        Ok(match self {
            Strategy::Caching => Arc::new(CachingResource::with_driver(ctx, PoolConfig::default())),
            Strategy::CachingExpandable => Arc::new(CachingResource::with_driver(
                ctx,
                PoolConfig { expandable_segments: true, ..PoolConfig::default() },
            )),
            Strategy::Native => Arc::new(NativePoolResource::new(MemPool::create(ctx, Default::default())?)),
            Strategy::Driver => Arc::new(DriverResource::new(ctx)),
        })
    }

    /// [`resource`](Strategy::resource), with a device that cannot run the strategy told apart from
    /// a failure: `Ok(Err(skipped))` where creating it says [`Error::NotSupported`] (the native pool
    /// on a device without memory pools), so that a comparison runs the other strategies.
    pub fn resource_or_skip(self, ctx: &Context) -> Result<Result<Arc<dyn DeviceResource>, Skipped>> {
        match self.resource(ctx) {
            Ok(resource) => Ok(Ok(resource)),
            Err(e @ Error::NotSupported { .. }) => Ok(Err(Skipped { strategy: self, reason: e.to_string() })),
            Err(e) => Err(e),
        }
    }

    /// Its colour in charts (distinct, and tested to be drawn).
    pub fn color(self) -> RGBColor {
        match self {
            Strategy::Caching => RGBColor(0x1f, 0x77, 0xb4),
            Strategy::CachingExpandable => RGBColor(0x94, 0x67, 0xbd),
            Strategy::Native => RGBColor(0xd6, 0x27, 0x28),
            Strategy::Driver => RGBColor(0x2c, 0xa0, 0x2c),
        }
    }
}

/// A strategy the device cannot run, left out of a comparison.
pub struct Skipped {
    /// The strategy left out.
    pub strategy: Strategy,
    /// Why, as the error creating it said.
    pub reason: String,
}

impl Skipped {
    /// The note printed for it.
    pub fn note(&self) -> String {
        format!("not run: {} ({})", self.strategy.name(), self.reason)
    }

    /// Its entry in JSON output.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "strategy": self.strategy.name(), "reason": self.reason })
    }
}

#[cfg(test)]
mod tests {
    use super::Strategy;

    #[test]
    fn every_name_fits_the_tables_first_column() {
        let longest = Strategy::ALL.iter().map(|s| s.name().len()).max().unwrap();
        assert_eq!(longest, Strategy::NAME_WIDTH);
    }
}
