//! The C header a kernel includes (`include/cumem_channel.h`) describes the same bytes as the Rust
//! types: a C program compiled here with the system compiler prints every `offsetof` and `sizeof`,
//! and each must equal the Rust side's.

use std::mem::{align_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use cumem_channel::{C_HEADER, CONTROL_OFFSETS, ControlBlock, RING_ARGS_OFFSETS, RingArgs};

const PROGRAM: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include "cumem_channel.h"
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
    printf("alignof cumem_control_block %zu\n", _Alignof(struct cumem_control_block));
    printf("sizeof cumem_ring_args %zu\n", sizeof(struct cumem_ring_args));
    printf("flags %u %u\n", CUMEM_CHANNEL_FLAG_CLOSED, CUMEM_CHANNEL_FLAG_DEVICE_TO_HOST);
    return 0;
}
"#;

#[test]
fn c_struct_offsets_match_the_rust_layout() {
    let dir = std::env::temp_dir().join(format!("cumem-channel-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("layout.c");
    std::fs::write(&source, PROGRAM).unwrap();
    let include = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include");
    assert_eq!(std::fs::read_to_string(include.join("cumem_channel.h")).unwrap(), C_HEADER);
    let exe = dir.join("layout");
    let cc = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(&source)
        .arg(format!("-I{}", include.display()))
        .output()
        .expect("the system C compiler `cc` runs");
    assert!(cc.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&cc.stderr));
    let run = Command::new(&exe).output().expect("run the layout program");
    assert!(run.status.success());
    let printed = String::from_utf8(run.stdout).unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    let mut expected: Vec<String> = Vec::new();
    expected.extend(CONTROL_OFFSETS.iter().map(|(f, o)| format!("cumem_control_block {f} {o}")));
    expected.extend(RING_ARGS_OFFSETS.iter().map(|(f, o)| format!("cumem_ring_args {f} {o}")));
    expected.push(format!("sizeof cumem_control_block {}", size_of::<ControlBlock>()));
    expected.push(format!("alignof cumem_control_block {}", align_of::<ControlBlock>()));
    expected.push(format!("sizeof cumem_ring_args {}", size_of::<RingArgs>()));
    expected.push(format!("flags {} {}", cumem_channel::FLAG_CLOSED, cumem_channel::FLAG_DEVICE_TO_HOST));
    assert_eq!(printed.lines().collect::<Vec<_>>(), expected);
}
