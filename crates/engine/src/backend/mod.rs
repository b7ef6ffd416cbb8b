//! Where the model's operations run. `cpu` is the one backend today: its kernels, threads and
//! floating-point mode; a GPU backend would sit beside it.

pub(crate) mod cpu;
