//! The emulated machine's settings, read once from the environment (documented in
//! emu/README.md).

use std::sync::OnceLock;
use std::time::Duration;

/// What happens when the emulator catches a misuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnError {
    /// Print the report and abort the process (the default: a test double must not let a bug
    /// pass).
    Abort,
    /// Print the report and return an error code where the API has one (for the emulator's own
    /// tests of error paths).
    Return,
}

/// The settings of the emulated machine.
#[derive(Clone, Debug)]
pub struct Config {
    /// `NCCL_RESHARD_EMU_DEVICES` (default 8).
    pub devices: i32,
    /// `NCCL_RESHARD_EMU_SM` (default `90`): compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `NCCL_RESHARD_EMU_DRIVER_VERSION` (default 12090).
    pub driver_version: i32,
    /// `NCCL_RESHARD_EMU_MEMORY_BYTES` (default 16 GiB): each device's total memory.
    pub memory_bytes: u64,
    /// `NCCL_RESHARD_EMU_PAGEABLE_DELAY_MS` (default 50): how long a synchronous HtoD copy from
    /// pageable memory stays pending on the legacy stream after the call returns.
    pub pageable_delay: Duration,
    /// `NCCL_RESHARD_EMU_ON_ERROR` (`abort`, default, or `return`).
    pub on_error: OnError,
    /// `NCCL_RESHARD_EMU_DEADLOCK_SECONDS` (default 20).
    pub deadlock: Duration,
    /// `NCCL_RESHARD_EMU_NCCL_VERSION` (default 22907: 2.29.7, which has revoke, shrink and grow).
    pub nccl_version: i32,
    /// How long a non-blocking communicator's init or group stays `ncclInProgress`.
    pub nonblocking_delay: Duration,
}

fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            crate::diag::fatal(format!("{name}={v:?} is not a valid value"));
        }),
        Err(_) => default,
    }
}

/// `90` → (9, 0), `86` → (8, 6), `100` → (10, 0), `120` → (12, 0).
fn compute_capability(sm: u32) -> (i32, i32) {
    ((sm / 10) as i32, (sm % 10) as i32)
}

/// The settings, read from the environment at first use.
pub fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let on_error = match std::env::var("NCCL_RESHARD_EMU_ON_ERROR").as_deref() {
            Ok("return") => OnError::Return,
            Ok("abort") | Err(_) => OnError::Abort,
            Ok(other) => crate::diag::fatal(format!(
                "NCCL_RESHARD_EMU_ON_ERROR={other:?}: use `abort` or `return`"
            )),
        };
        let sm: u32 = var("NCCL_RESHARD_EMU_SM", 90);
        if !(30..=129).contains(&sm) {
            crate::diag::fatal(format!(
                "NCCL_RESHARD_EMU_SM={sm}: give the architecture as sm_XY's digits (80, 90, 100)"
            ));
        }
        Config {
            devices: var("NCCL_RESHARD_EMU_DEVICES", 8),
            compute_capability: compute_capability(sm),
            driver_version: var("NCCL_RESHARD_EMU_DRIVER_VERSION", 12090),
            memory_bytes: var("NCCL_RESHARD_EMU_MEMORY_BYTES", 16u64 << 30),
            pageable_delay: Duration::from_millis(var("NCCL_RESHARD_EMU_PAGEABLE_DELAY_MS", 50)),
            on_error,
            deadlock: Duration::from_secs_f64(var("NCCL_RESHARD_EMU_DEADLOCK_SECONDS", 20.0)),
            nccl_version: var("NCCL_RESHARD_EMU_NCCL_VERSION", 22907),
            nonblocking_delay: Duration::from_millis(20),
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn architectures_split_into_major_and_minor() {
        assert_eq!(super::compute_capability(90), (9, 0));
        assert_eq!(super::compute_capability(86), (8, 6));
        assert_eq!(super::compute_capability(100), (10, 0));
        assert_eq!(super::compute_capability(120), (12, 0));
    }
}
