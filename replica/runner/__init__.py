"""The model runner: runs the model for a scheduled batch, the only place that builds
device tensors. One concept a module:

    model_runner    ModelRunner: construction, launch() of a step, graphs or eager forwards
    step_plan       which forward each of a step's sequences runs in (mixed, decode in prefill)
    forwards        Forwards: the prefill and decode forwards over the persistent buffers
    step_handle     TokenStaging, StepHandle: a step's sampled tokens on their way to the host
    decode_inputs   a decode (or mixed) step's inputs and changed block-table rows, one copy
    prefill_inputs  a prefill step's inputs, padded to captured buckets on CUDA
    graphs          CUDA graph capture of the forwards and the sizes they are captured at
    eager_graph     EagerGraph: a CUDA graph's stand-in on the CPU (tests)
    sampling        StepSampler: a step's sampled rows outside the graphs
    sampling_batch  SamplingBatch and the two ways to sample it (torch ops, kernels.sampling)
    graph_sampling  GraphSamplingInputs: the sampling graphs' inputs, in the step's copy
    kv_cache        the KV cache's dtype and how many blocks fit
    warm_up         the start-up run of every op a step launches outside the graphs

Nothing is imported here, so that importing one module does not import the others.
"""
