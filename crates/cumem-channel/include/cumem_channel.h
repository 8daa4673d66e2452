/* The control block of a cumem ring channel, as a CUDA C++ kernel (or C host code) sees it.
 * It mirrors `cumem_channel::ControlBlock` (#[repr(C, align(128))]) byte for byte; the crate's
 * tests compile this header as C11 and as C++17 and compare every offset with the Rust struct.
 *
 * Each field written by one side lives alone on its own 128-byte line (a GPU L2 line, two CPU
 * lines), so a producer and a consumer never write the same line. Positions are monotonic message
 * counts: the slot of position p is p % capacity; the ring is empty when head == tail and full when
 * tail - head == capacity. */
#ifndef CUMEM_CHANNEL_H
#define CUMEM_CHANNEL_H

#include <stdint.h>

/* C11 spells the alignment `_Alignas`, C++ (and so CUDA C++) `alignas`. */
#ifdef __cplusplus
#define CUMEM_CHANNEL_ALIGNAS(n) alignas(n)
#else
#define CUMEM_CHANNEL_ALIGNAS(n) _Alignas(n)
#endif

#define CUMEM_CHANNEL_LINE 128
#define CUMEM_CHANNEL_FLAG_CLOSED 1u
#define CUMEM_CHANNEL_FLAG_DEVICE_TO_HOST 2u

struct cumem_control_block {
    /* Consumer's line: messages consumed so far (written by the consumer only). */
    CUMEM_CHANNEL_ALIGNAS(128) uint64_t head;
    uint8_t pad_head[120];
    /* Producer's line: messages published so far (written by the producer only, after the slots). */
    uint64_t tail;
    uint8_t pad_tail[120];
    /* Producer's publish counter: incremented once per flush or batch (written by the producer). */
    uint64_t sequence;
    uint8_t pad_sequence[120];
    /* Read-mostly line, written by the host when the channel is made (and `flags` when closed). */
    uint64_t capacity;         /* slots in the ring */
    uint64_t message_size;     /* bytes per slot */
    uint64_t poll_interval_ns; /* how long a polling side waits between looks at the other's field */
    uint64_t flags;            /* CUMEM_CHANNEL_FLAG_* */
    uint8_t pad_config[96];
};

/* What a kernel receives for one channel: the control block and the slots, both device addresses. */
struct cumem_ring_args {
    uint64_t control; /* struct cumem_control_block * */
    uint64_t slots;   /* capacity * message_size bytes */
    uint64_t capacity;
    uint64_t message_size;
};

#endif
