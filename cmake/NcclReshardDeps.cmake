# Finds the NCCL and CUDA headers (and, when present, libnccl.so.2 and libcudart.so.12) that
# ncclReshard.h and programs using it need. Looked up, in order: NCCL_HOME / CUDA_HOME (CMake
# or environment variables), the PyPI wheels (nvidia-nccl-cu12, nvidia-cuda-runtime-cu12 and,
# for the wheels' cuda_runtime.h, nvidia-cuda-nvcc-cu12 + nvidia-cuda-cccl-cu12) of the
# Python found first on PATH, then the system.
#
# Sets NcclReshard_NCCL_INCLUDE_DIR, NcclReshard_CUDA_INCLUDE_DIRS and, when found,
# NcclReshard_NCCL_LIBRARY and NcclReshard_CUDART_LIBRARY.

set(_nr_wheel_dirs "")
find_program(_nr_python NAMES python3 python)
if(_nr_python)
  execute_process(
    COMMAND "${_nr_python}" -c "import nvidia; print(';'.join(nvidia.__path__))"
    OUTPUT_VARIABLE _nr_wheel_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()

set(_nr_nccl_hints "")
set(_nr_cuda_hints "")
foreach(_nr_var NCCL_HOME CUDA_HOME)
  if(DEFINED ${_nr_var})
    set(_nr_${_nr_var} "${${_nr_var}}")
  elseif(DEFINED ENV{${_nr_var}})
    set(_nr_${_nr_var} "$ENV{${_nr_var}}")
  endif()
endforeach()
if(_nr_NCCL_HOME)
  list(APPEND _nr_nccl_hints "${_nr_NCCL_HOME}")
endif()
if(_nr_CUDA_HOME)
  list(APPEND _nr_cuda_hints "${_nr_CUDA_HOME}")
endif()
foreach(_nr_dir IN LISTS _nr_wheel_dirs)
  list(APPEND _nr_nccl_hints "${_nr_dir}/nccl")
  list(APPEND _nr_cuda_hints "${_nr_dir}/cuda_runtime")
endforeach()

find_path(NcclReshard_NCCL_INCLUDE_DIR nccl.h HINTS ${_nr_nccl_hints} PATH_SUFFIXES include)
find_path(_nr_cuda_runtime_include cuda_runtime.h HINTS ${_nr_cuda_hints} PATH_SUFFIXES include
  PATHS /usr/local/cuda)
set(NcclReshard_CUDA_INCLUDE_DIRS "${_nr_cuda_runtime_include}")
# The runtime wheel's cuda_runtime.h needs crt/ (nvcc wheel) and nv/target (cccl wheel); a
# CUDA toolkit has them in the same include directory.
foreach(_nr_dir IN LISTS _nr_wheel_dirs)
  foreach(_nr_part cuda_nvcc cuda_cccl)
    if(EXISTS "${_nr_dir}/${_nr_part}/include")
      list(APPEND NcclReshard_CUDA_INCLUDE_DIRS "${_nr_dir}/${_nr_part}/include")
    endif()
  endforeach()
endforeach()

find_library(NcclReshard_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nr_nccl_hints}
  PATH_SUFFIXES lib lib64)
find_library(NcclReshard_CUDART_LIBRARY NAMES cudart libcudart.so.12 HINTS ${_nr_cuda_hints}
  PATH_SUFFIXES lib lib64 PATHS /usr/local/cuda)
