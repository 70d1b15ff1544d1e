// EaaS slot-and-flag helpers on the GPU: stream-ordered flag stores and BOUNDED flag waits.
//
// The flags are the int64 counters of the transport's slot headers (the same words the shm
// transport's host code reads and writes; see runtime/transport/cuda_ipc.py). On the GPU they
// live in host memory registered with cudaHostRegister(..., Mapped) (a memfd shared by the
// client and the server process), so a kernel store is seen by the peer's host loop and a peer's
// host store is seen by a kernel spinning here. Both kernels are single-thread launches with a
// fixed shape: they can be captured in a CUDA graph (the decode MoE round trip,
// eaas.runtime.client.graphs).
//
// A dead peer never hangs a stream: eaas_wait_flag gives up after timeout_ns (read from the
// %globaltimer nanosecond clock) and reports it in *status (1 = timed out), which the host
// watchdog reads after the graph / stream completes and turns into DeadlineExceeded.

// Store `value` into *flag after every earlier store of this stream's kernels is visible
// system-wide (payload before flag, the slot protocol's ordering rule).
extern "C" __global__ void eaas_signal_flag(volatile long long* flag, long long value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    __threadfence_system();
    *flag = value;
    __threadfence_system();
  }
}

__device__ __forceinline__ unsigned long long eaas_globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *flag == want or timeout_ns elapse. status[0] = 0 (seen) or 1 (timed out).
// `want` is read from *want_ptr (device/mapped memory) so a captured graph can wait for a
// counter that changes on every replay.
extern "C" __global__ void eaas_wait_flag(volatile const long long* flag,
                                          const long long* want_ptr,
                                          unsigned long long timeout_ns, int* status) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const long long want = *want_ptr;
  const unsigned long long t0 = eaas_globaltimer_ns();
  while (true) {
    if (*flag == want) {
      __threadfence_system();  // payload reads after the flag read
      status[0] = 0;
      return;
    }
    if (eaas_globaltimer_ns() - t0 > timeout_ns) {
      status[0] = 1;
      return;
    }
    __nanosleep(256);
  }
}

// *counter += 1 on the device, then signal it into *flag: the per-replay sequence counter of a
// captured round trip (the host never has to touch the graph between replays).
extern "C" __global__ void eaas_bump_and_signal(long long* counter, volatile long long* flag) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    long long v = *counter + 1;
    *counter = v;
    __threadfence_system();
    *flag = v;
    __threadfence_system();
  }
}
