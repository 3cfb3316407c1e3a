// main() of the emulator executable. Python (mini_vllm/csrc/emulation/__init__.py) starts one
// process per op call and writes the request on stdin:
//
//   op paged_attention_v1
//   buf <name> <fd> <offset> <bytes> <ro|rw>   a buffer: bytes at offset of an inherited file
//   int <name> <value>
//   float <name> <value>
//
// Each buffer is mapped from the caller's file (no copy: a cache of gigabytes whose pages were
// never written costs nothing) between two inaccessible pages; read-only buffers are mapped
// read-only, so a kernel that writes an input crashes instead of changing it. Under
// AddressSanitizer the bytes around each buffer are poisoned too, so an access one element past
// the end is reported. The op's status goes to stdout ("MINI_VLLM_EMU_STATUS <code> <message>");
// errors in the kernels go to stderr (see runtime.cpp) with a non-zero exit status.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

#include "driver.h"
#include "runtime.h"

#if defined(MINI_VLLM_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#endif

namespace mini_vllm_emu {

namespace {

std::map<std::string, OpFunction>& ops() {
  static std::map<std::string, OpFunction> registry;
  return registry;
}

[[noreturn]] void bad_request(const std::string& what) {
  fprintf(stderr, "MINI_VLLM_EMU_BAD_REQUEST %s\n", what.c_str());
  _exit(2);
}

Buffer map_buffer(const std::string& name, int fd, size_t offset, size_t bytes, bool writable) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t start = offset & ~(page - 1);
  const size_t delta = offset - start;
  const size_t span = (delta + bytes + page - 1) / page * page;
  // [guard page][the file's pages][guard page]
  char* reserve = static_cast<char*>(
      mmap(nullptr, span + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (reserve == MAP_FAILED) bad_request("cannot reserve address space for " + name);
  char* base = reserve + page;
  if (span > 0) {
    const int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
    if (mmap(base, span, prot, MAP_SHARED | MAP_FIXED, fd, static_cast<off_t>(start)) == MAP_FAILED) {
      bad_request("cannot map " + name + ": " + strerror(errno));
    }
  }
  Buffer b;
  b.data = bytes == 0 ? reserve : base + delta;  // an empty buffer: any access faults
  b.bytes = bytes;
  b.writable = writable;
#if defined(MINI_VLLM_EMU_ASAN)
  // Everything around the buffer, guard pages included, is poisoned: ASan then reports an
  // overrun as such instead of the guard page's segmentation fault.
  __asan_poison_memory_region(reserve, page + delta);
  __asan_poison_memory_region(base + delta + bytes, span - delta - bytes + page);
#endif
  register_region(writable ? name : name + " (read-only)", b.data, bytes);
  return b;
}

Request read_request(std::istream& in) {
  Request r;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream words(line);
    std::string kind, name;
    words >> kind;
    if (kind == "op") {
      words >> r.op;
    } else if (kind == "buf") {
      int fd = -1;
      size_t offset = 0, bytes = 0;
      std::string mode;
      words >> name >> fd >> offset >> bytes >> mode;
      if (!words || (mode != "ro" && mode != "rw")) bad_request("bad buffer line: " + line);
      r.buffers[name] = map_buffer(name, fd, offset, bytes, mode == "rw");
    } else if (kind == "int" || kind == "float") {
      std::string value;
      words >> name >> value;
      if (!words) bad_request("bad scalar line: " + line);
      r.scalars[name] = value;
    } else {
      bad_request("unknown request line: " + line);
    }
  }
  if (r.op.empty()) bad_request("the request names no op");
  return r;
}

}  // namespace

void* Request::buffer(const std::string& name) const {
  auto it = buffers.find(name);
  if (it == buffers.end()) bad_request("op " + op + " needs buffer " + name);
  return it->second.data;
}

size_t Request::bytes(const std::string& name) const {
  auto it = buffers.find(name);
  if (it == buffers.end()) bad_request("op " + op + " needs buffer " + name);
  return it->second.bytes;
}

int64_t Request::integer(const std::string& name) const {
  auto it = scalars.find(name);
  if (it == scalars.end()) bad_request("op " + op + " needs integer " + name);
  return std::strtoll(it->second.c_str(), nullptr, 10);
}

double Request::real(const std::string& name) const {
  auto it = scalars.find(name);
  if (it == scalars.end()) bad_request("op " + op + " needs number " + name);
  return std::strtod(it->second.c_str(), nullptr);
}

OpRegistration::OpRegistration(const char* name, OpFunction fn) { ops()[name] = fn; }

void report_status(int code, const char* message) {
  printf("MINI_VLLM_EMU_STATUS %d %s\n", code, message ? message : "");
  fflush(stdout);
}

}  // namespace mini_vllm_emu

int main(int argc, char** argv) {
  using namespace mini_vllm_emu;
  initialize();
  if (argc == 2 && strcmp(argv[1], "--list-ops") == 0) {
    for (const auto& [name, fn] : ops()) printf("%s\n", name.c_str());
    return 0;
  }
  Request request = read_request(std::cin);
  auto it = ops().find(request.op);
  if (it == ops().end()) bad_request("this build has no op " + request.op);
  it->second(request);
  fflush(stdout);
  return 0;
}
