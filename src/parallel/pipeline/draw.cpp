#include "parallel/pipeline/draw.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>

#include "core/error.h"
#include "core/png.h"

#ifdef LOOM_HAVE_CAIRO
#include <cairo.h>
#endif

namespace loom::parallel::pipeline {

Timeline schedule_timeline(const Schedule& sch, const CheckResult& res) {
  LOOM_CHECK(res.ok && res.ranks.size() == sch.ranks.size(), "pipeline draw: the schedule did not pass the checker: {}",
             res.error);
  Timeline tl;
  tl.title = fmt::format("{}  p={} v={} m={}", kind_name(sch.spec.kind), sch.p(), sch.v(), sch.m());
  tl.rows.resize(sch.ranks.size());
  for (size_t r = 0; r < sch.ranks.size(); ++r)
    for (size_t i = 0; i < sch.ranks[r].size(); ++i) {
      const Instr& in = sch.ranks[r][i];
      if (!is_compute(in.op)) continue;
      tl.rows[r].push_back({res.ranks[r].start[i], res.ranks[r].end[i], in.op, in.mb, in.chunk});
    }
  return tl;
}

namespace {
// Fill colour of a box: forward blue, backward green, backward-input teal, weight orange; later
// chunks darker.
void colour(const Box& b, double rgb[3]) {
  double base[3];
  switch (b.op) {
    case Op::forward: base[0] = 0.35, base[1] = 0.55, base[2] = 0.95; break;
    case Op::backward: base[0] = 0.35, base[1] = 0.78, base[2] = 0.40; break;
    case Op::backward_input: base[0] = 0.20, base[1] = 0.75, base[2] = 0.70; break;
    default: base[0] = 0.98, base[1] = 0.65, base[2] = 0.25; break;
  }
  const double k = 1.0 - 0.22 * b.chunk;
  for (int i = 0; i < 3; ++i) rgb[i] = std::max(0.05, base[i] * std::max(0.3, k));
}
}  // namespace

bool draw_png(const std::string& path, const Timeline& tl, std::string* why) {
  (void)why;
#ifndef LOOM_HAVE_CAIRO
  (void)path;
  (void)tl;
  if (why) *why = "this build has no Cairo (libcairo2-dev), so no PNG pictures";
  return false;
#else
  double t1 = 0;
  for (const auto& row : tl.rows)
    for (const Box& b : row) t1 = std::max(t1, b.end);
  if (t1 <= 0) t1 = 1;
  const int nrows = std::max<int>(1, int(tl.rows.size()));
  const double L = tl.labels.empty() ? 70 : 140, R = 20, T = 50, Bm = 60, row_h = 34;
  // (Wide enough for the title at 16 px: about 9 px a character.)
  const int width = int(std::clamp(std::max(L + R + 900.0, L + 9.0 * double(tl.title.size())), 400.0, 2400.0));
  const int height = int(T + Bm + row_h * nrows);
  const double pw = width - L - R;
  auto X = [&](double t) { return L + t / t1 * pw; };

  cairo_surface_t* surf = cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height);
  cairo_t* cr = cairo_create(surf);
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
  cairo_set_font_size(cr, 16);
  cairo_move_to(cr, L, 30);
  cairo_show_text(cr, tl.title.c_str());
  cairo_set_font_size(cr, 12);
  for (int r = 0; r < nrows; ++r) {
    const double y = T + r * row_h;
    cairo_set_source_rgb(cr, 0.95, 0.95, 0.95);
    cairo_rectangle(cr, L, y + 2, pw, row_h - 4);
    cairo_fill(cr);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    std::string lab = size_t(r) < tl.labels.size() ? tl.labels[size_t(r)] : fmt::format("rank {}", r);
    cairo_move_to(cr, 8, y + row_h / 2 + 4);
    cairo_show_text(cr, lab.c_str());
    if (size_t(r) >= tl.rows.size()) continue;
    for (const Box& b : tl.rows[size_t(r)]) {
      double rgb[3];
      colour(b, rgb);
      const double x0 = X(b.start), x1 = X(b.end);
      cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
      cairo_rectangle(cr, x0, y + 3, std::max(1.0, x1 - x0), row_h - 6);
      cairo_fill_preserve(cr);
      cairo_set_source_rgb(cr, 1, 1, 1);
      cairo_set_line_width(cr, 1);
      cairo_stroke(cr);
      std::string s = std::to_string(b.mb);
      cairo_text_extents_t e;
      cairo_text_extents(cr, s.c_str(), &e);
      if (e.width + 2 < x1 - x0) {
        cairo_set_source_rgb(cr, 0, 0, 0);
        cairo_move_to(cr, (x0 + x1 - e.width) / 2, y + row_h / 2 + e.height / 2);
        cairo_show_text(cr, s.c_str());
      }
    }
  }
  // Legend.
  const Box legend[] = {{0, 0, Op::forward}, {0, 0, Op::backward}, {0, 0, Op::backward_input}, {0, 0, Op::backward_weight}};
  const char* names[] = {"forward", "backward", "backward (input)", "backward (weight)"};
  double lx = L;
  const double ly = T + nrows * row_h + 20;
  for (int i = 0; i < 4; ++i) {
    double rgb[3];
    colour(legend[i], rgb);
    cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
    cairo_rectangle(cr, lx, ly, 14, 14);
    cairo_fill(cr);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    cairo_move_to(cr, lx + 20, ly + 12);
    cairo_show_text(cr, names[i]);
    cairo_text_extents_t e;
    cairo_text_extents(cr, names[i], &e);
    lx += 20 + e.x_advance + 24;
  }
  cairo_destroy(cr);
  write_png(surf, path);
  return true;
#endif
}

std::string draw_text(const Timeline& tl, double unit) {
  LOOM_CHECK(unit > 0, "pipeline draw: unit must be positive");
  double t1 = 0;
  for (const auto& row : tl.rows)
    for (const Box& b : row) t1 = std::max(t1, b.end);
  const size_t cols = size_t(std::ceil(t1 / unit - 1e-9));
  std::string out = tl.title + "\n";
  for (size_t r = 0; r < tl.rows.size(); ++r) {
    std::string line(cols, '.');
    for (const Box& b : tl.rows[r]) {
      char c = b.op == Op::forward ? 'F' : b.op == Op::backward ? 'B' : b.op == Op::backward_input ? 'I' : 'W';
      if (b.chunk % 2) c = char(c - 'A' + 'a');
      for (size_t k = size_t(std::llround(b.start / unit)); k < size_t(std::llround(b.end / unit)) && k < cols; ++k)
        line[k] = c;
    }
    out += fmt::format("{:>3} {}\n", r, line);
  }
  return out;
}

}  // namespace loom::parallel::pipeline
