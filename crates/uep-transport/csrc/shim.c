/*
 * uep-transport C shim over libfabric.
 *
 * Why a shim: almost every fi_* call is a `static inline` in the libfabric
 * headers (dispatch through ops tables), so Rust cannot link to them
 * directly, and the fi_info tree is a deep struct whose layout we would
 * rather not mirror by hand. This file exposes small, flat, non-inline
 * wrappers; the Rust side (src/ffi.rs) declares exactly these.
 * No logic lives here beyond argument marshalling.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/* ---- fi_info: hints and inspection ------------------------------------ */

struct fi_info *uep_fi_allocinfo(void) { return fi_allocinfo(); }

void uep_fi_freeinfo(struct fi_info *info) { fi_freeinfo(info); }

/* Fill RMA hints. Strings are duplicated because fi_freeinfo frees them. */
int uep_fi_hints_set(struct fi_info *h, uint64_t caps, uint64_t mode, int mr_mode,
                     int ep_type, int threading, const char *prov_name,
                     const char *domain_name) {
    h->caps = caps;
    h->mode = mode;
    h->ep_attr->type = (enum fi_ep_type)ep_type;
    h->domain_attr->mr_mode = mr_mode;
    h->domain_attr->threading = (enum fi_threading)threading;
    if (prov_name) {
        h->fabric_attr->prov_name = strdup(prov_name);
        if (!h->fabric_attr->prov_name) return -FI_ENOMEM;
    }
    if (domain_name) {
        h->domain_attr->name = strdup(domain_name);
        if (!h->domain_attr->name) return -FI_ENOMEM;
    }
    return 0;
}

int uep_fi_getinfo(const char *node, uint64_t flags, const struct fi_info *hints,
                   struct fi_info **out) {
    return fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), node, NULL,
                      flags, hints, out);
}

struct fi_info *uep_fi_next(const struct fi_info *info) { return info->next; }

/* Flat view of the fields uep looks at. Strings borrow from `info`. */
struct uep_info_view {
    const char *prov_name;
    const char *fabric_name;
    const char *domain_name;
    uint64_t caps;
    uint64_t mode;
    uint64_t tx_caps;
    uint64_t rx_caps;
    uint64_t tx_msg_order;
    uint64_t rx_msg_order;
    uint64_t tx_comp_order;
    uint64_t rx_comp_order;
    uint64_t max_msg_size;
    uint64_t tx_size;
    uint64_t rx_size;
    uint64_t cq_data_size;
    uint64_t mr_key_size;
    uint64_t inject_size;
    int32_t ep_type;
    int32_t mr_mode;
    int32_t av_type;
    int32_t threading;
    uint32_t addr_format;
    uint32_t _pad;
};

void uep_fi_view(const struct fi_info *i, struct uep_info_view *v) {
    memset(v, 0, sizeof(*v));
    v->prov_name = i->fabric_attr ? i->fabric_attr->prov_name : NULL;
    v->fabric_name = i->fabric_attr ? i->fabric_attr->name : NULL;
    v->domain_name = i->domain_attr ? i->domain_attr->name : NULL;
    v->caps = i->caps;
    v->mode = i->mode;
    if (i->tx_attr) {
        v->tx_caps = i->tx_attr->caps;
        v->tx_msg_order = i->tx_attr->msg_order;
        v->tx_comp_order = i->tx_attr->comp_order;
        v->tx_size = i->tx_attr->size;
        v->inject_size = i->tx_attr->inject_size;
        /* tx/rx attr modes are folded into the info mode: uep treats them alike. */
        v->mode |= i->tx_attr->mode;
    }
    if (i->rx_attr) {
        v->rx_caps = i->rx_attr->caps;
        v->rx_msg_order = i->rx_attr->msg_order;
        v->rx_comp_order = i->rx_attr->comp_order;
        v->rx_size = i->rx_attr->size;
        v->mode |= i->rx_attr->mode;
    }
    if (i->ep_attr) {
        v->max_msg_size = i->ep_attr->max_msg_size;
        v->ep_type = (int32_t)i->ep_attr->type;
    }
    if (i->domain_attr) {
        v->cq_data_size = i->domain_attr->cq_data_size;
        v->mr_key_size = i->domain_attr->mr_key_size;
        v->mr_mode = i->domain_attr->mr_mode;
        v->av_type = (int32_t)i->domain_attr->av_type;
        v->threading = (int32_t)i->domain_attr->threading;
    }
    v->addr_format = i->addr_format;
}

/* ---- object lifetime --------------------------------------------------- */

int uep_fabric_open(const struct fi_info *info, struct fid_fabric **fabric) {
    return fi_fabric(info->fabric_attr, fabric, NULL);
}

int uep_domain_open(struct fid_fabric *fabric, struct fi_info *info,
                    struct fid_domain **domain) {
    return fi_domain(fabric, info, domain, NULL);
}

int uep_cq_open(struct fid_domain *domain, size_t size, struct fid_cq **cq) {
    struct fi_cq_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.size = size;
    attr.format = FI_CQ_FORMAT_DATA;
    attr.wait_obj = FI_WAIT_NONE; /* proxies busy-poll; no fds needed */
    return fi_cq_open(domain, &attr, cq, NULL);
}

int uep_av_open(struct fid_domain *domain, int av_type, size_t count, struct fid_av **av) {
    struct fi_av_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.type = (enum fi_av_type)av_type;
    attr.count = count;
    return fi_av_open(domain, &attr, av, NULL);
}

int uep_ep_open(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep) {
    return fi_endpoint(domain, info, ep, NULL);
}

int uep_ep_bind_cq(struct fid_ep *ep, struct fid_cq *cq, uint64_t flags) {
    return fi_ep_bind(ep, &cq->fid, flags);
}

int uep_ep_bind_av(struct fid_ep *ep, struct fid_av *av) {
    return fi_ep_bind(ep, &av->fid, 0);
}

int uep_ep_enable(struct fid_ep *ep) { return fi_enable(ep); }

int uep_mr_reg(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
               uint64_t requested_key, struct fid_mr **mr) {
    return fi_mr_reg(domain, buf, len, access, 0, requested_key, 0, mr, NULL);
}

uint64_t uep_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }

void *uep_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }

int uep_mr_bind_ep(struct fid_mr *mr, struct fid_ep *ep) {
    return fi_mr_bind(mr, &ep->fid, 0);
}

int uep_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }

int uep_getname(struct fid_ep *ep, void *buf, size_t *len) {
    return fi_getname(&ep->fid, buf, len);
}

int uep_av_insert(struct fid_av *av, const void *addr, uint64_t *fi_addr) {
    fi_addr_t a = FI_ADDR_NOTAVAIL;
    int n = fi_av_insert(av, addr, 1, &a, 0, NULL);
    *fi_addr = (uint64_t)a;
    return n;
}

/* Every fid_* type starts with `struct fid fid`, so one close serves all. */
int uep_close(void *obj) { return fi_close((struct fid *)obj); }

/* ---- data path --------------------------------------------------------- */

ssize_t uep_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc,
                      uint64_t data, uint64_t dest, uint64_t addr, uint64_t key,
                      void *ctx) {
    return fi_writedata(ep, buf, len, desc, data, (fi_addr_t)dest, addr, key, ctx);
}

ssize_t uep_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, void *ctx) {
    return fi_recv(ep, buf, len, desc, FI_ADDR_UNSPEC, ctx);
}

ssize_t uep_atomic_add_u64(struct fid_ep *ep, const uint64_t *operand, void *desc,
                           uint64_t dest, uint64_t addr, uint64_t key, void *ctx) {
    return fi_atomic(ep, operand, 1, desc, (fi_addr_t)dest, addr, key, FI_UINT64,
                     FI_SUM, ctx);
}

/* 0 when the endpoint can do a non-fetching u64 sum. */
int uep_query_atomic_add_u64(struct fid_domain *domain) {
    struct fi_atomic_attr attr;
    memset(&attr, 0, sizeof(attr));
    return fi_query_atomic(domain, FI_UINT64, FI_SUM, &attr, 0);
}

ssize_t uep_cq_read(struct fid_cq *cq, struct fi_cq_data_entry *buf, size_t count) {
    return fi_cq_read(cq, buf, count);
}

/* Flat error entry; `msg` receives fi_cq_strerror's text (NUL-terminated). */
struct uep_cq_err {
    void *op_context;
    uint64_t flags;
    uint64_t data;
    int32_t err;
    int32_t prov_errno;
};

ssize_t uep_cq_readerr(struct fid_cq *cq, struct uep_cq_err *out, char *msg, size_t msglen) {
    struct fi_cq_err_entry e;
    memset(&e, 0, sizeof(e));
    ssize_t rc = fi_cq_readerr(cq, &e, 0);
    if (rc < 0) return rc;
    out->op_context = e.op_context;
    out->flags = e.flags;
    out->data = e.data;
    out->err = e.err;
    out->prov_errno = e.prov_errno;
    if (msg && msglen) {
        const char *s = fi_cq_strerror(cq, e.prov_errno, e.err_data, NULL, 0);
        if (!s) s = fi_strerror(e.err);
        strncpy(msg, s ? s : "", msglen - 1);
        msg[msglen - 1] = '\0';
    }
    return rc;
}

const char *uep_strerror(int err) { return fi_strerror(err); }

/* ---- constants --------------------------------------------------------- */

/*
 * The Rust side hard-codes the flag values it uses (they are ABI-stable);
 * this table lets a unit test prove they match the headers we built with.
 * Order must match `ffi::CONST_NAMES` on the Rust side.
 */
size_t uep_const_table(uint64_t *out, size_t n) {
    const uint64_t t[] = {
        FI_MSG, FI_RMA, FI_ATOMIC, FI_READ, FI_WRITE, FI_RECV, FI_SEND,
        FI_REMOTE_READ, FI_REMOTE_WRITE, FI_SOURCE,
        FI_REMOTE_CQ_DATA, FI_TRANSMIT, FI_CONTEXT, FI_CONTEXT2, FI_RX_CQ_DATA,
        FI_MR_LOCAL, FI_MR_RAW, FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY,
        FI_MR_MMU_NOTIFY, FI_MR_RMA_EVENT, FI_MR_ENDPOINT, FI_MR_HMEM,
        FI_ORDER_STRICT, FI_ORDER_DATA, FI_ORDER_WAW, FI_ORDER_RMA_WAW,
        FI_EP_MSG, FI_EP_DGRAM, FI_EP_RDM,
        FI_AV_MAP, FI_AV_TABLE, FI_THREAD_DOMAIN, FI_EAGAIN, FI_EAVAIL,
        FI_ENODATA, FI_KEY_NOTAVAIL, FI_ADDR_NOTAVAIL,
        sizeof(struct fi_cq_data_entry), sizeof(struct fi_context2),
    };
    size_t total = sizeof(t) / sizeof(t[0]);
    for (size_t i = 0; i < n && i < total; i++) out[i] = t[i];
    return total;
}
