//! Data-parallel training from Rust through ddp-cpp's C ABI (include/ddp/c_api.h), with
//! Debian's rustc alone: no crates, the few declarations it uses written out below.
//!
//!     ddprun --nproc-per-node 3 build/examples/rust_ddp_linear
//!
//! A linear model (4 weights and a bias) learns y = 2 x0 - x1 + 0.5 x2 + 3 x3 + 1 from 96
//! samples, 20 epochs of mini-batches of 8 per rank. Each rank trains on its shard of every
//! epoch (ddp-cpp's DistributedSampler); after each backward (computed by hand here, as a
//! Rust framework would) the gradients are averaged over the ranks with ddp_all_reduce, so
//! every rank takes the same step. At the end every rank gathers every rank's weights and
//! checks they are bitwise identical, prints its loss and a checksum of its weights' bits,
//! and exits 0 only if the replicas agree and the loss fell.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::process::exit;

// The part of include/ddp/c_api.h this program uses (DDP_C_API_VERSION 1).
const DDP_C_API_VERSION: c_int = 1;
const DDP_OK: c_int = 0;
const DDP_FLOAT32: c_int = 0;
const DDP_INT64: c_int = 5;
const DDP_SUM: c_int = 0;
const DDP_AVG: c_int = 1;

#[repr(C)]
struct DdpGroup {
    _private: [u8; 0],
}
#[repr(C)]
struct DdpSampler {
    _private: [u8; 0],
}

#[link(name = "ddp")]
extern "C" {
    fn ddp_last_error() -> *const c_char;
    fn ddp_version() -> *const c_char;
    fn ddp_group_create(abi: c_int, backend: *const c_char, rank: c_int, world: c_int,
                        addr: *const c_char, port: c_int, out: *mut *mut DdpGroup) -> c_int;
    fn ddp_group_destroy(group: *mut DdpGroup);
    fn ddp_group_rank(group: *const DdpGroup) -> c_int;
    fn ddp_group_size(group: *const DdpGroup) -> c_int;
    fn ddp_all_reduce(group: *mut DdpGroup, data: *mut c_void, count: usize, dtype: c_int,
                      op: c_int) -> c_int;
    fn ddp_all_gather(group: *mut DdpGroup, output: *mut c_void, input: *const c_void,
                      count: usize, dtype: c_int) -> c_int;
    fn ddp_sampler_create(group: *const DdpGroup, size: i64, shuffle: c_int, seed: u64,
                          drop_last: c_int, out: *mut *mut DdpSampler) -> c_int;
    fn ddp_sampler_destroy(sampler: *mut DdpSampler);
    fn ddp_sampler_set_epoch(sampler: *mut DdpSampler, epoch: i64) -> c_int;
    fn ddp_sampler_length(sampler: *const DdpSampler) -> i64;
    fn ddp_sampler_indices(sampler: *const DdpSampler, out: *mut i64, capacity: usize,
                           written: *mut usize) -> c_int;
}

// A failed call ends the program with the library's message (rank, call, cause, remedy).
fn check(rc: c_int, what: &str) {
    if rc != DDP_OK {
        let msg = unsafe { CStr::from_ptr(ddp_last_error()) }.to_string_lossy().into_owned();
        eprintln!("rust_ddp_linear: {} failed ({}): {}", what, rc, msg);
        exit(1);
    }
}

const SAMPLES: usize = 96;
const FEATURES: usize = 4;
const BATCH: usize = 8;
const EPOCHS: i64 = 20;
const LR: f32 = 0.1;

// The same data on every rank: a linear congruential generator from a fixed seed.
fn dataset() -> (Vec<[f32; FEATURES]>, Vec<f32>) {
    let mut state: u64 = 12345;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    let truth = [2.0f32, -1.0, 0.5, 3.0];
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for _ in 0..SAMPLES {
        let x = [next(), next(), next(), next()];
        let y = x.iter().zip(truth.iter()).map(|(a, b)| a * b).sum::<f32>() + 1.0 + 0.01 * next();
        xs.push(x);
        ys.push(y);
    }
    (xs, ys)
}

// Mean squared error over `batch`, and its gradient (4 weights, then the bias).
fn loss_and_grad(w: &[f32; FEATURES + 1], xs: &[[f32; FEATURES]], ys: &[f32], batch: &[i64])
                 -> (f32, [f32; FEATURES + 1]) {
    let mut grad = [0.0f32; FEATURES + 1];
    let mut loss = 0.0f32;
    for &i in batch {
        let (x, y) = (&xs[i as usize], ys[i as usize]);
        let pred = (0..FEATURES).map(|k| w[k] * x[k]).sum::<f32>() + w[FEATURES];
        let err = pred - y;
        loss += err * err;
        for k in 0..FEATURES {
            grad[k] += 2.0 * err * x[k];
        }
        grad[FEATURES] += 2.0 * err;
    }
    let n = batch.len() as f32;
    for g in grad.iter_mut() {
        *g /= n;
    }
    (loss / n, grad)
}

fn main() {
    let mut group: *mut DdpGroup = std::ptr::null_mut();
    // rank -1: placement from ddprun's (torchrun's) environment.
    check(unsafe { ddp_group_create(DDP_C_API_VERSION, std::ptr::null(), -1, -1,
                                    std::ptr::null(), 0, &mut group) }, "ddp_group_create");
    let (rank, world) = unsafe { (ddp_group_rank(group), ddp_group_size(group)) };
    let (xs, ys) = dataset();
    let mut sampler: *mut DdpSampler = std::ptr::null_mut();
    check(unsafe { ddp_sampler_create(group, SAMPLES as i64, 1, 0, 0, &mut sampler) },
          "ddp_sampler_create");

    let mut w = [0.0f32; FEATURES + 1];
    let mut first_loss = f32::NAN;
    let mut last_loss = f32::NAN;
    for epoch in 0..EPOCHS {
        check(unsafe { ddp_sampler_set_epoch(sampler, epoch) }, "ddp_sampler_set_epoch");
        let mut indices = vec![0i64; unsafe { ddp_sampler_length(sampler) } as usize];
        let mut written = 0usize;
        check(unsafe { ddp_sampler_indices(sampler, indices.as_mut_ptr(), indices.len(),
                                           &mut written) }, "ddp_sampler_indices");
        for batch in indices[..written].chunks(BATCH) {
            let (loss, mut grad) = loss_and_grad(&w, &xs, &ys, batch);
            // The data-parallel step: every rank's gradient becomes the mean over ranks.
            check(unsafe { ddp_all_reduce(group, grad.as_mut_ptr() as *mut c_void, grad.len(),
                                          DDP_FLOAT32, DDP_AVG) }, "ddp_all_reduce");
            for k in 0..w.len() {
                w[k] -= LR * grad[k];
            }
            let mut mean_loss = [loss];
            check(unsafe { ddp_all_reduce(group, mean_loss.as_mut_ptr() as *mut c_void, 1,
                                          DDP_FLOAT32, DDP_AVG) }, "ddp_all_reduce");
            if first_loss.is_nan() {
                first_loss = mean_loss[0];
            }
            last_loss = mean_loss[0];
        }
    }

    // Every rank's weights, bit for bit: the replicas must be one model.
    let mut all = vec![0.0f32; w.len() * world as usize];
    check(unsafe { ddp_all_gather(group, all.as_mut_ptr() as *mut c_void,
                                  w.as_ptr() as *const c_void, w.len(), DDP_FLOAT32) },
          "ddp_all_gather");
    let identical = all.chunks(w.len())
        .all(|other| other.iter().zip(w.iter()).all(|(a, b)| a.to_bits() == b.to_bits()));
    let mut disagree = [if identical { 0i64 } else { 1 }];
    check(unsafe { ddp_all_reduce(group, disagree.as_mut_ptr() as *mut c_void, 1, DDP_INT64,
                                  DDP_SUM) }, "ddp_all_reduce");
    let checksum = w.iter().fold(0xcbf29ce484222325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x100000001b3)
    });
    let version = unsafe { CStr::from_ptr(ddp_version()) }.to_string_lossy().into_owned();
    println!("rank {} of {} (ddp-cpp {}): loss {:.4} -> {:.6}, weights {:?}, checksum {:016x}, \
              replicas identical: {}",
             rank, world, version, first_loss, last_loss, w, checksum, disagree[0] == 0);
    unsafe {
        ddp_sampler_destroy(sampler);
        ddp_group_destroy(group);
    }
    exit(if disagree[0] == 0 && last_loss < first_loss / 10.0 { 0 } else { 1 });
}
