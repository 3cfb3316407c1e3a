// The emulator executable's side of a call from Python: a request names an op, its scalar
// arguments and its buffers (shared-memory files, mapped here without copying). Op bindings
// (op_bindings.cpp, or a test's own file) register their ops with MINI_VLLM_EMU_OP.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace mini_vllm_emu {

struct Buffer {
  void* data = nullptr;
  size_t bytes = 0;
  bool writable = false;
};

class Request {
 public:
  std::string op;
  std::map<std::string, Buffer> buffers;
  std::map<std::string, std::string> scalars;

  bool has(const std::string& name) const { return buffers.count(name) != 0; }
  // The mapped data of buffer `name` (a fatal error when the request lacks it).
  void* buffer(const std::string& name) const;
  size_t bytes(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  double real(const std::string& name) const;
};

using OpFunction = void (*)(Request&);

struct OpRegistration {
  OpRegistration(const char* name, OpFunction fn);
};

// Reports an op's outcome to Python: 0 ok, 1 not implemented, 2 unsupported, 3 CUDA error
// (mini_vllm::StatusCode), with a message.
void report_status(int code, const char* message);

}  // namespace mini_vllm_emu

#define MINI_VLLM_EMU_OP(name)                                                       \
  static void mini_vllm_emu_op_##name(::mini_vllm_emu::Request& req);                \
  static const ::mini_vllm_emu::OpRegistration mini_vllm_emu_registration_##name(    \
      #name, &mini_vllm_emu_op_##name);                                              \
  static void mini_vllm_emu_op_##name(::mini_vllm_emu::Request& req)
