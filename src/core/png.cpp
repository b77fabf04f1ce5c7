#include "core/png.h"

#ifdef LOOM_HAVE_CAIRO
#include <cairo.h>

#include <memory>

#include "core/error.h"
#include "core/file.h"

namespace loom {

void write_png(cairo_surface_t* surface, const std::string& path) {
  std::unique_ptr<cairo_surface_t, void (*)(cairo_surface_t*)> owned(surface, cairo_surface_destroy);
  std::string png;
  auto append = [](void* closure, const unsigned char* data, unsigned int length) {
    static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
    return CAIRO_STATUS_SUCCESS;
  };
  const cairo_status_t st = cairo_surface_write_to_png_stream(surface, append, &png);
  if (st != CAIRO_STATUS_SUCCESS)
    throw Error(fmt::format("{}: cannot encode the PNG: {}", path, cairo_status_to_string(st)));
  write_file_atomically(path, png);
}

}  // namespace loom
#endif
