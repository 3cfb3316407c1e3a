// What the emulation driver (driver.cpp) and the op bindings use of the runtime besides the CUDA
// API of cuda_emulation.h.
#pragma once

#include <cstddef>
#include <string>

namespace mini_vllm_emu {

// Installs the crash and sanitizer hooks; idempotent.
void initialize();

// Names a memory region so that error reports say "key_cache" rather than an address.
void register_region(const std::string& name, const void* begin, size_t bytes);

// The modelled device's key ("default", "t4", "a100", "h100").
const char* device_key();

// Reports an error (with the kernel, block and thread when inside one) and exits with status 3.
[[noreturn]] void fatal(const std::string& message);

}  // namespace mini_vllm_emu
