//! Asks the built simulator library which symbols it exports (`dlsym` through libloading), so
//! that tests compare claims against the real library rather than against a list in the code.

use std::sync::OnceLock;

/// Whether the simulator library exports `symbol`.
pub fn exported(symbol: &str) -> bool {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    let lib = LIB.get_or_init(|| {
        let path = cumem_sim::library_path().expect("libcumem_sim.so is built beside the tests");
        // SAFETY: loading the simulator runs no foreign initialisers beyond Rust's.
        unsafe { libloading::Library::new(path) }.expect("load the simulator")
    });
    let name = format!("{symbol}\0");
    // SAFETY: only the symbol's presence is checked; nothing is called through it.
    unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok()
}
