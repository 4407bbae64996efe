pub mod cuda;
pub mod host;
