#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "core/png.h"

#ifdef LOOM_HAVE_CAIRO
#include <cairo.h>
#endif

namespace loom::train {

namespace {
// A "nice" tick step for a range: 1, 2 or 5 times a power of ten, about n ticks.
double nice_step(double range, int n) {
  double raw = range / n, mag = std::pow(10.0, std::floor(std::log10(raw)));
  double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}
std::string tick_label(double v, double step) {
  char buf[32];
  if (step >= 1) std::snprintf(buf, sizeof buf, "%.0f", v);
  else if (step >= 0.1) std::snprintf(buf, sizeof buf, "%.1f", v);
  else if (step >= 0.01) std::snprintf(buf, sizeof buf, "%.2f", v);
  else std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}
}  // namespace

bool plot_png(const std::string& path, const std::string& title, const std::vector<Series>& series,
              const std::string& ylabel, std::string* why, int width, int height) {
#ifndef LOOM_HAVE_CAIRO
  if (why) *why = "this build has no Cairo (libcairo2-dev), so no PNG plots";
  return false;
#else
  double x0 = std::numeric_limits<double>::max(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series)
    for (auto [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x); x1 = std::max(x1, x);
      y0 = std::min(y0, y); y1 = std::max(y1, y);
    }
  if (x0 > x1) { x0 = 0; x1 = 1; y0 = 0; y1 = 1; }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) { y0 -= 0.5; y1 += 0.5; }
  double pad = 0.05 * (y1 - y0);
  y0 -= pad; y1 += pad;

  const double L = 80, R = 30, T = 50, B = 60;
  double pw = width - L - R, ph = height - T - B;
  auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * pw; };
  auto Y = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * ph; };

  cairo_surface_t* surf = cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height);
  cairo_t* cr = cairo_create(surf);
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);

  // Grid and ticks.
  cairo_set_font_size(cr, 12);
  cairo_set_line_width(cr, 1);
  double xs = nice_step(x1 - x0, 8), ys = nice_step(y1 - y0, 6);
  for (double v = std::ceil(x0 / xs) * xs; v <= x1 + 1e-9; v += xs) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, X(v), T); cairo_line_to(cr, X(v), T + ph); cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    std::string s = tick_label(v, xs);
    cairo_text_extents_t e; cairo_text_extents(cr, s.c_str(), &e);
    cairo_move_to(cr, X(v) - e.width / 2, T + ph + 18); cairo_show_text(cr, s.c_str());
  }
  for (double v = std::ceil(y0 / ys) * ys; v <= y1 + 1e-9; v += ys) {
    cairo_set_source_rgb(cr, 0.9, 0.9, 0.9);
    cairo_move_to(cr, L, Y(v)); cairo_line_to(cr, L + pw, Y(v)); cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    std::string s = tick_label(v, ys);
    cairo_text_extents_t e; cairo_text_extents(cr, s.c_str(), &e);
    cairo_move_to(cr, L - e.width - 8, Y(v) + 4); cairo_show_text(cr, s.c_str());
  }
  cairo_set_source_rgb(cr, 0, 0, 0);
  cairo_rectangle(cr, L, T, pw, ph); cairo_stroke(cr);

  // Labels.
  cairo_set_font_size(cr, 16);
  cairo_move_to(cr, L, 30); cairo_show_text(cr, title.c_str());
  cairo_set_font_size(cr, 13);
  cairo_move_to(cr, L + pw / 2 - 15, height - 15); cairo_show_text(cr, "step");
  cairo_save(cr);
  cairo_move_to(cr, 20, T + ph / 2 + 20); cairo_rotate(cr, -M_PI / 2); cairo_show_text(cr, ylabel.c_str());
  cairo_restore(cr);

  // Series and legend.
  int li = 0;
  for (const auto& s : series) {
    cairo_set_source_rgb(cr, s.r, s.g, s.b);
    cairo_set_line_width(cr, 1.8);
    bool started = false;
    for (auto [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      if (!started) { cairo_move_to(cr, X(x), Y(y)); started = true; }
      else cairo_line_to(cr, X(x), Y(y));
    }
    if (s.points.size() == 1 && started) cairo_arc(cr, X(s.points[0].first), Y(s.points[0].second), 3, 0, 2 * M_PI);
    cairo_stroke(cr);
    double ly = T + 20 + 20 * li++;
    cairo_move_to(cr, L + pw - 175, ly); cairo_line_to(cr, L + pw - 145, ly); cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    cairo_move_to(cr, L + pw - 137, ly + 4); cairo_show_text(cr, s.label.c_str());
  }
  cairo_destroy(cr);
  write_png(surf, path);
  return true;
#endif
}

}  // namespace loom::train
