# Runs a small `laga train` twice, on 2 in-process ranks and on 2 MPI
# processes, and requires the logged loss and grad_norm of every step to be
# bit-identical (the JSON numbers round-trip doubles exactly). With -DPYTHON
# set, it trains on packed documents (--pack-eos 0) of a token file that
# Python writes: documents of 1 to 13 tokens, crossing the ranks' shards.
# With -DMOE_CONFIG set, the model is that --config's (an MoE with the
# experts' bias balancing on, whose load all-reduce runs every step).
# With -DEXPERT_PARALLEL=ON both runs pass --expert-parallel (the MoE's
# experts folded onto the ranks: all_to_all_v dispatch and combine), and
# with -DEP=N also --ep N (EP groups of N ranks, each holding every expert).
# With -DDSA=ON the model has DeepSeek Sparse Attention (3 dense warm-up
# steps, then top-8 of 32; index_kl compared too). With -DSP=N the runs are
# on N ranks (default 2). With -DPP=N they are N
# pipeline stages instead (--sp 1 --pp N --micro-batches 2: the activations
# and their gradients passed between the processes). With -DDTYPE=bf16 they
# train in bf16 mixed precision (flash attention), the activations and the
# MoE's dispatch and combine on the wire as bf16 (mla/wire.hpp). With -DPERTURB=SEED both
# runs pass --perturb-reductions SEED, and a third, local run without it must
# differ from them in some step's loss or grad_norm: the switch reaches the
# training's reductions, and local and MPI still agree bit for bit under it.
if(NOT MPIEXEC OR NOT EXISTS "${MPIEXEC}")
  message(FATAL_ERROR "mpiexec was not found when the build was configured (MPIEXEC='${MPIEXEC}'): "
                      "install openmpi-bin (scripts/setup.sh) and re-run cmake")
endif()
if(NOT SP)
  set(SP 2)
endif()
set(RANKS ${SP})
if(PP)
  set(RANKS ${PP})
  set(SP 1)
endif()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
if(DSA)
  # A DeepSeek Sparse Attention model (model/dsa_layer.hpp): at --sp > 1 its
  # layers run the query-local latent gather; the form options are refused.
  set(ARGS train --sp ${SP} --layers 2 --d-model 32 --heads 4 --q-lora-rank 16 --index-heads 2
           --index-head-dim 8 --index-topk 8 --index-warmup 3 --seq 32 --batch 2 --vocab 64
           --steps 6 --lr 3e-3 --seed 7 --quiet)
elseif(MOE_CONFIG)
  set(ARGS train --form laga --sp ${SP} --config ${MOE_CONFIG} --seq 32 --batch 2 --steps 6 --lr 3e-3
           --seed 7 --quiet)
else()
  set(ARGS train --form laga --sp ${SP} --layers 2 --d-model 32 --heads 4 --seq 32 --batch 2
           --vocab 64 --steps 6 --lr 3e-3 --seed 7 --quiet)
endif()
if(PP)
  list(APPEND ARGS --pp ${PP} --micro-batches 2)
endif()
if(EXPERT_PARALLEL)
  list(APPEND ARGS --expert-parallel)
endif()
if(EP)
  list(APPEND ARGS --ep ${EP})
endif()
if(DTYPE)
  list(APPEND ARGS --dtype ${DTYPE} --attention flash)
endif()
if(PYTHON)
  string(CONCAT script "import array\nids = array.array('H')\nd = 0\nwhile len(ids) < 3000:\n"
             "    n = 1 + (7 * d) % 13\n    ids.extend([1 + (d + 3 * i) % 60 for i in range(n - 1)] + [0])\n"
             "    d += 1\nids.tofile(open('${WORK}/docs.bin', 'wb'))\n")
  execute_process(COMMAND ${PYTHON} -c "${script}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "could not write the packed token file (${rc})")
  endif()
  list(APPEND ARGS --data ${WORK}/docs.bin --pack-eos 0)
endif()
set(BACKENDS local mpi)
if(DEFINED PERTURB)
  set(PLAIN_ARGS ${ARGS})
  list(APPEND ARGS --perturb-reductions ${PERTURB})
  list(APPEND BACKENDS plain)
endif()
foreach(backend ${BACKENDS})
  if(backend STREQUAL "plain")
    set(CMD ${TIMEOUT} 120 ${LAGA} ${PLAIN_ARGS} --comm local --log ${WORK}/plain.jsonl)
  elseif(backend STREQUAL "mpi")
    set(CMD ${TIMEOUT} 120 ${MPIEXEC} --allow-run-as-root --oversubscribe -np ${RANKS} ${LAGA} ${ARGS}
            --comm mpi --log ${WORK}/mpi.jsonl)
  else()
    set(CMD ${TIMEOUT} 120 ${LAGA} ${ARGS} --comm local --log ${WORK}/local.jsonl)
  endif()
  execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${backend} run failed (${rc}):\n${out}\n${err}")
  endif()
endforeach()
file(STRINGS ${WORK}/local.jsonl local_lines)
file(STRINGS ${WORK}/mpi.jsonl mpi_lines)
list(LENGTH local_lines n_local)
list(LENGTH mpi_lines n_mpi)
if(NOT n_local EQUAL 6 OR NOT n_mpi EQUAL 6)
  message(FATAL_ERROR "expected 6 log lines each, got local ${n_local}, mpi ${n_mpi}")
endif()
math(EXPR last "${n_local} - 1")
foreach(i RANGE ${last})
  list(GET local_lines ${i} a)
  list(GET mpi_lines ${i} b)
  set(keys loss grad_norm lr targets)
  if(DSA)
    list(APPEND keys index_kl dsa_stage)
  endif()
  foreach(key ${keys})
    string(JSON va GET "${a}" ${key})
    string(JSON vb GET "${b}" ${key})
    if(NOT va STREQUAL vb)
      message(FATAL_ERROR "step ${i}: ${key} local ${va} != mpi ${vb}\nlocal: ${a}\nmpi:   ${b}")
    endif()
  endforeach()
  if(PYTHON)
    string(JSON targets GET "${a}" targets)
    if(NOT targets LESS 64)
      message(FATAL_ERROR "step ${i}: --pack-eos counted ${targets} targets, not fewer than B*S")
    endif()
  endif()
  message(STATUS "step ${i}: ${a}")
endforeach()
message(STATUS "local and MPI losses are bit-identical over ${n_local} steps")
if(DEFINED PERTURB)
  file(STRINGS ${WORK}/plain.jsonl plain_lines)
  set(moved 0)
  foreach(i RANGE ${last})
    list(GET local_lines ${i} a)
    list(GET plain_lines ${i} b)
    foreach(key loss grad_norm)
      string(JSON va GET "${a}" ${key})
      string(JSON vb GET "${b}" ${key})
      if(NOT va STREQUAL vb)
        set(moved 1)
      endif()
    endforeach()
  endforeach()
  if(NOT moved)
    message(FATAL_ERROR "--perturb-reductions ${PERTURB} at --sp ${SP} logged exactly the "
                        "losses and grad norms of the run without it: the switch changed nothing")
  endif()
  message(STATUS "--perturb-reductions ${PERTURB} moved the losses off the rank-order run")
endif()
