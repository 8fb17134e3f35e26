// Included last by a shader built with DEP = 1 (see common.glsl): the dispatch's own main
// (renamed op_main) runs between a wait and a signal on counters in memory.
// dep_wait: the counter of the dispatch this one reads from (0xFFFFFFFF: none), to reach
// dep_expect (that dispatch's workgroup count); dep_signal: this dispatch's counter, which every
// workgroup bumps once its writes are done (0xFFFFFFFF: none). One invocation per workgroup
// spins; the workgroup barrier with device-scope acquire makes the producer's writes visible
// to all of them, and the one with release before the bump makes this workgroup's writes
// visible before its count.
#if DEP
#undef main
void main() {
    if (pc.dep_wait != 0xFFFFFFFFu) {
        if (gl_LocalInvocationIndex == 0u) {
            U32Buf counters = U32Buf(pc.dep_counters);
            while (atomicLoad(counters.v[pc.dep_wait], gl_ScopeDevice, gl_StorageSemanticsBuffer,
                              gl_SemanticsAcquire) < pc.dep_expect) {
            }
        }
        controlBarrier(gl_ScopeWorkgroup, gl_ScopeDevice, gl_StorageSemanticsBuffer, gl_SemanticsAcquireRelease);
    }
    op_main();
    if (pc.dep_signal != 0xFFFFFFFFu) {
        controlBarrier(gl_ScopeWorkgroup, gl_ScopeDevice, gl_StorageSemanticsBuffer, gl_SemanticsAcquireRelease);
        if (gl_LocalInvocationIndex == 0u)
            atomicAdd(U32Buf(pc.dep_counters).v[pc.dep_signal], 1u, gl_ScopeDevice, gl_StorageSemanticsBuffer,
                      gl_SemanticsRelease);
    }
}
#endif
