/* Input to scripts/gen-bindings.sh: the UCP API surface tandem-ucx-sys exposes. */
#include <ucp/api/ucp.h>
