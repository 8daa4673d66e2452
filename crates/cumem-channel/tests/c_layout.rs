//! The C header a kernel includes (`include/cumem_channel.h`) describes the same bytes as the Rust
//! types: a program compiled here with the system compilers, as C11 and as C++17 (the language a
//! CUDA kernel is written in), prints every `offsetof` and `sizeof`, and each must equal the Rust
//! side's. The C struct `docs/channels.md` shows must be the header's text, and the guide's kernel
//! skeleton is compiled against the header (syntax only, with CUDA's keywords stubbed: no CUDA
//! toolkit here), so a field it reads that the header lacks, or a header C++ cannot parse, fails.

use std::mem::{align_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use cumem_channel::{C_HEADER, CONTROL_OFFSETS, ControlBlock, RING_ARGS_OFFSETS, RingArgs};

const PROGRAM: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include "cumem_channel.h"
#ifdef __cplusplus
#define ALIGN_OF(t) alignof(t)
#else
#define ALIGN_OF(t) _Alignof(t)
#endif
#define FIELD(s, f) printf(#s " " #f " %zu\n", offsetof(struct s, f))
int main(void) {
    FIELD(cumem_control_block, head);
    FIELD(cumem_control_block, tail);
    FIELD(cumem_control_block, sequence);
    FIELD(cumem_control_block, capacity);
    FIELD(cumem_control_block, message_size);
    FIELD(cumem_control_block, poll_interval_ns);
    FIELD(cumem_control_block, flags);
    FIELD(cumem_ring_args, control);
    FIELD(cumem_ring_args, slots);
    FIELD(cumem_ring_args, capacity);
    FIELD(cumem_ring_args, message_size);
    printf("sizeof cumem_control_block %zu\n", sizeof(struct cumem_control_block));
    printf("alignof cumem_control_block %zu\n", ALIGN_OF(struct cumem_control_block));
    printf("sizeof cumem_ring_args %zu\n", sizeof(struct cumem_ring_args));
    printf("flags %u %u\n", CUMEM_CHANNEL_FLAG_CLOSED, CUMEM_CHANNEL_FLAG_DEVICE_TO_HOST);
    return 0;
}
"#;

/// What nvcc provides and a host C++ compiler does not, for a syntax check of device code.
const CUDA_STUBS: &str = r#"
#define __global__
#define __device__
struct cumem_dim3 { unsigned x, y, z; };
static const cumem_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0};
static inline void __nanosleep(unsigned) {}
"#;

fn include_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cumem-channel-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `compiler` with `args` on `source`, the header's directory included; panics with its
/// diagnostics if it fails.
fn compile(compiler: &str, args: &[&str], source: &Path) {
    let out = Command::new(compiler)
        .args(["-Wall", "-Wextra", "-Werror"])
        .args(args)
        .arg(format!("-I{}", include_dir().display()))
        .arg(source)
        .output()
        .unwrap_or_else(|e| panic!("the system compiler `{compiler}` runs: {e}"));
    assert!(out.status.success(), "{compiler} {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

/// The lines the layout program must print: the Rust side's offsets and sizes.
fn expected() -> Vec<String> {
    let mut expected: Vec<String> = Vec::new();
    expected.extend(CONTROL_OFFSETS.iter().map(|(f, o)| format!("cumem_control_block {f} {o}")));
    expected.extend(RING_ARGS_OFFSETS.iter().map(|(f, o)| format!("cumem_ring_args {f} {o}")));
    expected.push(format!("sizeof cumem_control_block {}", size_of::<ControlBlock>()));
    expected.push(format!("alignof cumem_control_block {}", align_of::<ControlBlock>()));
    expected.push(format!("sizeof cumem_ring_args {}", size_of::<RingArgs>()));
    expected.push(format!("flags {} {}", cumem_channel::FLAG_CLOSED, cumem_channel::FLAG_DEVICE_TO_HOST));
    expected
}

fn layout_printed_by(compiler: &str, language: &[&str]) -> Vec<String> {
    let dir = scratch(compiler);
    let source = dir.join("layout.src");
    std::fs::write(&source, PROGRAM).unwrap();
    let exe = dir.join("layout");
    let mut args = vec!["-o", exe.to_str().unwrap()];
    args.extend_from_slice(language);
    compile(compiler, &args, &source);
    let run = Command::new(&exe).output().expect("run the layout program");
    assert!(run.status.success());
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8(run.stdout).unwrap().lines().map(str::to_owned).collect()
}

#[test]
fn the_header_is_the_one_the_crate_exports() {
    assert_eq!(std::fs::read_to_string(include_dir().join("cumem_channel.h")).unwrap(), C_HEADER);
}

#[test]
fn c_struct_offsets_match_the_rust_layout() {
    assert_eq!(layout_printed_by("cc", &["-std=c11", "-x", "c"]), expected());
}

#[test]
fn cpp_struct_offsets_match_the_rust_layout() {
    assert_eq!(layout_printed_by("c++", &["-std=c++17", "-x", "c++"]), expected());
}

/// The first fenced block of `docs/channels.md` in `lang`.
fn docs_block(lang: &str) -> String {
    let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/channels.md");
    let text = std::fs::read_to_string(&docs).expect("docs/channels.md");
    let fence = format!("```{lang}\n");
    let start = text.find(&fence).unwrap_or_else(|| panic!("docs/channels.md has a {fence}")) + fence.len();
    let len = text[start..].find("```").expect("the block's fence is closed");
    text[start..start + len].to_string()
}

#[test]
fn the_docs_c_struct_is_the_headers() {
    let block = docs_block("c");
    let body = block.trim_start().split_once('\n').map(|(first, rest)| {
        assert!(first.starts_with("//"), "the block opens with a comment on the alignment macro");
        rest
    });
    let body = body.expect("the C block has a struct after its comment").trim_end();
    assert!(body.starts_with("struct cumem_control_block {"), "{body}");
    assert!(C_HEADER.contains(body), "docs/channels.md shows another C struct than the header's:\n{body}");
}

#[test]
fn the_docs_kernel_skeleton_reads_the_header() {
    let kernel = &docs_block("cpp");
    assert!(kernel.contains("#include \"cumem_channel.h\""), "the skeleton includes the header");
    let dir = scratch("kernel");
    let (stubs, source) = (dir.join("cuda_stubs.h"), dir.join("kernel.cu"));
    std::fs::write(&stubs, CUDA_STUBS).unwrap();
    std::fs::write(&source, kernel).unwrap();
    compile(
        "c++",
        &["-std=c++17", "-fsyntax-only", "-include", stubs.to_str().unwrap(), "-x", "c++"],
        &source,
    );
    let _ = std::fs::remove_dir_all(&dir);
}
