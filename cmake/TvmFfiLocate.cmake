# Locate the apache-tvm-ffi CMake package of the Python environment that builds us.
#
# Honours -Dtvm_ffi_DIR=... and -DPython_EXECUTABLE=... (setup.py passes both); otherwise asks
# `tvm-ffi-config --cmakedir`, then `python -m tvm_ffi.config --cmakedir`.
if(NOT tvm_ffi_DIR)
  find_program(TVM_FFI_CONFIG_EXECUTABLE tvm-ffi-config)
  if(TVM_FFI_CONFIG_EXECUTABLE)
    execute_process(
      COMMAND "${TVM_FFI_CONFIG_EXECUTABLE}" --cmakedir
      OUTPUT_VARIABLE _tvm_ffi_cmakedir
      OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _tvm_ffi_rc)
  endif()
  if(NOT _tvm_ffi_cmakedir OR NOT _tvm_ffi_rc EQUAL 0)
    find_package(Python COMPONENTS Interpreter REQUIRED)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -m tvm_ffi.config --cmakedir
      OUTPUT_VARIABLE _tvm_ffi_cmakedir
      OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _tvm_ffi_rc)
  endif()
  if(NOT _tvm_ffi_rc EQUAL 0 OR NOT _tvm_ffi_cmakedir)
    message(FATAL_ERROR
      "Cannot locate apache-tvm-ffi: install it (pip install apache-tvm-ffi==0.1.14.post1) "
      "or pass -Dtvm_ffi_DIR=$(tvm-ffi-config --cmakedir)")
  endif()
  set(tvm_ffi_DIR "${_tvm_ffi_cmakedir}" CACHE PATH "apache-tvm-ffi CMake package directory")
endif()
# tvm_ffi-config.cmake itself runs `${Python_EXECUTABLE} -m tvm_ffi.config`.
find_package(Python COMPONENTS Interpreter REQUIRED)
find_package(tvm_ffi CONFIG REQUIRED)
message(STATUS "tvm_ffi: ${tvm_ffi_DIR} (library ${tvm_ffi_LIB_FILES})")
