// The reference build of lab 02-06's probes: attention_core.cuh's steps 1 and 2 run alone
// (attention_probes.cuh). The lab's tests run the same probes on the student's starter.cu.
#include "attention_core.cuh"
#include "attention_probes.cuh"

namespace mini_vllm {

Status launch_qk_logits_probe(const PagedAttentionParams& p, const QkLogitsProbe& probe,
                              cudaStream_t stream) {
  return run_qk_logits_probe(p, probe, stream);
}

Status launch_softmax_probe(const SoftmaxProbe& probe, cudaStream_t stream) {
  return run_softmax_probe(probe, stream);
}

}  // namespace mini_vllm
