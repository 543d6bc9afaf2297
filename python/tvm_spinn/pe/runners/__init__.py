"""The host side of each PE kernel family's tiles in the ``iss`` execution
(:func:`tvm_spinn.pe.execute.run_program_iss`): the DMA's part (operands placed in a PE's SRAM,
results read back) around the jobs the generated kernel runs."""
