//! Power-loss simulation: a VFS that models what a disk keeps across a power cut, a short inbox workload run
//! through it, and a checker that reopens the inbox from what each cut leaves.
#![allow(dead_code)]

pub mod check;
pub mod disk;
pub mod vfs;
pub mod workload;
