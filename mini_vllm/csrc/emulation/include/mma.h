// Emulation stand-in for the CUDA toolkit's <mma.h> (nvcuda::wmma): the emulation build puts this
// folder first on the include path, so the kernel sources compile with the host C++ compiler (see
// ../cuda_emulation.h, which emulates the warp matrix operations). No CUDA toolkit is needed.
#pragma once
#include "../cuda_emulation.h"
