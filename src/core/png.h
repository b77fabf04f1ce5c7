// A cairo image as a PNG file, written whole or not at all (core/file.h's AtomicFile).
#pragma once
#include <string>

#ifdef LOOM_HAVE_CAIRO
typedef struct _cairo_surface cairo_surface_t;

namespace loom {

// Encodes `surface` as PNG into `path` and destroys the surface (also when it throws). Throws
// Error naming path when cairo cannot encode it or the file cannot be written.
void write_png(cairo_surface_t* surface, const std::string& path);

}  // namespace loom
#endif
