// Compiled alone to the cubin that the Record stage hands to XLA (build.sh).
#include "add_kernel.cuh"
