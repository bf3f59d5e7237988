/* An intrusive doubly linked list: the node lives inside the element (struct x { ...; bt_list_node link; }), the
 * list owns nothing, and the caller's lock guards it. O(1) insert at the front and removal of any element.
 *
 *   bt_list pending = {0};
 *   bt_list_push_front(&pending, &x->link);
 *   BT_LIST_FOR(it, &pending, struct x, link) { ... }   (the body must not remove `it`)
 *   bt_list_remove(&pending, &x->link);                 (a node not in the list, or removed twice, is a no-op)
 *
 * A node that was never inserted must be zeroed (calloc, or {0}) for bt_list_remove to know it is not listed.
 */
#ifndef BATON_COMMON_LIST_H
#define BATON_COMMON_LIST_H

#include <stddef.h>

typedef struct bt_list_node {
    struct bt_list_node *prev, *next;
} bt_list_node;

typedef struct bt_list {
    bt_list_node *head;
} bt_list;

/* The element that holds node ptr as its member `member`. */
#define bt_list_entry(ptr, type, member) ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

static inline void bt_list_push_front(bt_list *l, bt_list_node *n)
{
    n->prev = NULL;
    n->next = l->head;
    if (l->head) l->head->prev = n;
    l->head = n;
}

/* Returns 1 when n was in l and is now out of it, 0 when it was not listed (nothing changes). */
static inline int bt_list_remove(bt_list *l, bt_list_node *n)
{
    if (n->prev)
        n->prev->next = n->next;
    else if (l->head == n)
        l->head = n->next;
    else
        return 0; /* not in this list */
    if (n->next) n->next->prev = n->prev;
    n->prev = n->next = NULL;
    return 1;
}

static inline int bt_list_empty(const bt_list *l)
{
    return l->head == NULL;
}

/* var (a type *) walks the list from the front. */
#define BT_LIST_FOR(var, list, type, member)                                                                   \
    for (type *var = (list)->head ? bt_list_entry((list)->head, type, member) : NULL; var;                     \
         var = var->member.next ? bt_list_entry(var->member.next, type, member) : NULL)

#endif
