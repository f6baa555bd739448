// Included by every ISA file that opens a target pragma, at its end: closes that pragma, so that
// nothing compiled after the kernel is compiled for the ISA. No include guard: it acts where it is
// included, once per file.
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
