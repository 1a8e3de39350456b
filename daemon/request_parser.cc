#include "daemon/request_parser.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"

namespace deltad::daemon {

namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::io::CodedInputStream;

// Our messages nest three deep; deeper input is left to protobuf.
constexpr int kMaxDepth = 8;

enum class WireType : uint32_t {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kFixed32 = 5,
};

// Whether a message of this type can hold a string anywhere inside it: the
// scan descends only into those, so a large batch of numbers is skipped in
// one step.
bool MayHoldStrings(const Descriptor& type, int depth) {
  if (depth > kMaxDepth) return false;
  for (int i = 0; i < type.field_count(); ++i) {
    const FieldDescriptor& f = *type.field(i);
    if (f.type() == FieldDescriptor::TYPE_STRING) return true;
    if (f.type() == FieldDescriptor::TYPE_MESSAGE &&
        MayHoldStrings(*f.message_type(), depth + 1)) {
      return true;
    }
  }
  return false;
}

// What the scan of one message found.
enum class Scan {
  kClean,        // every string field is UTF-8 (or the scan gave up)
  kInvalidUtf8,  // `field` names the first that is not
};

// Walks the wire bytes of one message of `type`, reading only the string
// fields and the messages that may hold some. Anything it cannot follow
// (groups, truncation) ends the scan as clean: protobuf's parse then
// decides, and refuses what is malformed.
Scan FindInvalidUtf8(CodedInputStream& in, const Descriptor& type, int depth,
                     const std::string& prefix, std::string* field) {
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return Scan::kClean;
    const auto wire = static_cast<WireType>(tag & 7);
    const FieldDescriptor* f =
        type.FindFieldByNumber(static_cast<int>(tag >> 3));
    switch (wire) {
      case WireType::kVarint: {
        uint64_t ignored;
        if (!in.ReadVarint64(&ignored)) return Scan::kClean;
        break;
      }
      case WireType::kFixed64: {
        uint64_t ignored;
        if (!in.ReadLittleEndian64(&ignored)) return Scan::kClean;
        break;
      }
      case WireType::kFixed32: {
        uint32_t ignored;
        if (!in.ReadLittleEndian32(&ignored)) return Scan::kClean;
        break;
      }
      case WireType::kLengthDelimited: {
        uint32_t length;
        if (!in.ReadVarint32(&length)) return Scan::kClean;
        const std::string name =
            f == nullptr ? "" : absl::StrCat(prefix, ".", f->name());
        if (f != nullptr && f->type() == FieldDescriptor::TYPE_STRING) {
          std::string text;
          if (!in.ReadString(&text, static_cast<int>(length))) {
            return Scan::kClean;
          }
          if (!IsValidUtf8(text)) {
            *field = name;
            return Scan::kInvalidUtf8;
          }
        } else if (f != nullptr && f->type() == FieldDescriptor::TYPE_MESSAGE &&
                   depth < kMaxDepth &&
                   MayHoldStrings(*f->message_type(), depth + 1)) {
          const auto limit = in.PushLimit(static_cast<int>(length));
          const Scan inner =
              FindInvalidUtf8(in, *f->message_type(), depth + 1, name, field);
          if (inner != Scan::kClean) return inner;
          if (in.BytesUntilLimit() != 0) return Scan::kClean;  // gave up
          in.PopLimit(limit);
        } else if (!in.Skip(static_cast<int>(length))) {
          return Scan::kClean;
        }
        break;
      }
      default:
        return Scan::kClean;
    }
  }
}

}  // namespace

bool IsValidUtf8(absl::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const unsigned char* const end = p + text.size();
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int n;                               // continuation bytes
    unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return false;
    }
    if (end - p <= n) return false;
    if (p[1] < lo || p[1] > hi) return false;
    for (int i = 2; i <= n; ++i) {
      if (p[i] < 0x80 || p[i] > 0xBF) return false;
    }
    p += n + 1;
  }
  return true;
}

absl::Status ParseRequest(absl::string_view wire,
                          google::protobuf::Message& message) {
  message.Clear();
  const Descriptor& type = *message.GetDescriptor();
  {
    CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()),
                        static_cast<int>(wire.size()));
    std::string field;
    if (FindInvalidUtf8(in, type, 0, type.name(), &field) ==
        Scan::kInvalidUtf8) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is not valid UTF-8"));
    }
  }
  if (!message.ParseFromArray(wire.data(), static_cast<int>(wire.size()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request is not a valid ", type.full_name(), " message"));
  }
  return absl::OkStatus();
}

}  // namespace deltad::daemon
