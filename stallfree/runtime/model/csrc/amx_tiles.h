// What the AMX translation units share (isa_amx.cpp, amx_gemm.cpp, amx_prefill_attention.cpp):
// the tile configuration and tile memory operations kept in program order, with blocks16.h's
// 16 x 16 output blocks. Included by each unit after its target pragma and inside its own
// namespace, so it is compiled for that unit's instruction set; includes nothing else.

// the tile configuration `ldtilecfg` reads: palette 1, then bytes per row and rows per tile
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's tile-load intrinsics do not tell the compiler all they read: `_tile_loadd` names no
// memory at all and `_tile_loadconfig` only the configuration's first 8 bytes. The compiler
// may then move the stores that fill what a tile loads past the load, or drop them as dead
// (an int4 block unpacked into a buffer the tiles read came out wrong once the code around it
// was rearranged; a configuration filled in a loop lost its row and width stores). A
// compiler barrier on each side of every load keeps them in program order; it emits nothing.
// A tile store is fenced the same way, so the code that reads what it stored stays after it.
#define SF_TILE_MEMORY(op)          \
  do {                              \
    asm volatile("" ::: "memory");  \
    op;                             \
    asm volatile("" ::: "memory");  \
  } while (0)
#define SF_TILE_LOADD(tile, base, stride) SF_TILE_MEMORY(_tile_loadd(tile, base, stride))
#define SF_TILE_STORED(tile, base, stride) SF_TILE_MEMORY(_tile_stored(tile, base, stride))

inline void load_config(const TileConfig& cfg) {
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

#include "blocks16.h"

